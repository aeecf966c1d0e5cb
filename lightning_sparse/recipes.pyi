# Type stub for lightning_sparse.recipes. That package is the top-level recipes/ folder, installed
# under this name by pyproject's [tool.setuptools.package-dir]; mypy does not follow package-dir
# mappings (nor the editable install's import hook), so without this stub it cannot find the
# module. Keep it in step with recipes/__init__.py (tests/app/test_dev_pins.py checks the names).
from pathlib import Path

RECIPES_DIR: Path
