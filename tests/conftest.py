from __future__ import annotations

import sys
from pathlib import Path

# Test helpers (builders, provider_server) are imported as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
