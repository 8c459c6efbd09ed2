"""Print the README's quickstart: the first ```python block under "## Quickstart".

CI runs what this prints against the installed wheel, so the README cannot drift from
what the package does. Usage: ``python scripts/readme_quickstart.py [README.md]``.
"""

from __future__ import annotations

import sys
from pathlib import Path


def quickstart(readme: str) -> str:
    """The code of the first ```python block in the "## Quickstart" section."""
    section = readme.split("\n## Quickstart\n", 1)
    if len(section) != 2:
        raise SystemExit("README has no '## Quickstart' section")
    body = section[1].split("\n## ", 1)[0]
    block = body.split("```python\n", 1)
    if len(block) != 2 or "\n```" not in block[1]:
        raise SystemExit("README's '## Quickstart' section has no ```python block")
    return block[1].split("```", 1)[0]


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    sys.stdout.write(quickstart(path.read_text(encoding="utf-8")))
