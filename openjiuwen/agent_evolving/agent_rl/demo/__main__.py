"""`python -m openjiuwen.agent_evolving.agent_rl.demo`: the demo driver (same as `openjiuwen-rl demo`)."""

import sys

from .run import main

sys.exit(main())
