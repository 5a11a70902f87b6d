import sys
from pathlib import Path

# The spawned ranks import helpers from this folder by module name.
sys.path.insert(0, str(Path(__file__).parent))
