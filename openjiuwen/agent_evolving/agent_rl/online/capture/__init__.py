"""The capture pipeline: hook body parsing, request normalization, response validation, sample building."""
