"""The read-only web console under `/console`: its pages and assets (console_assets/), the views, and the login
token exchanged for a session cookie."""
