"""Which Hugging Face libraries `--model` runs with, checked before any of them is imported.

The floors are pyproject.toml's `hf` extra (tests/test_packaging.py keeps them equal) and what
CI's compatibility job tests (.ci/run: the oldest and the newest release). Below them the
capture fails inside transformers (its attention interface, mask builders and
`set_attn_implementation` arrived over several releases), so an older install is refused with
the versions named instead. The install advice is the command that works where attnviz runs: an
editable install from a checkout, or the package's extra.
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
from pathlib import Path

from attnviz.errors import UsageError, option

# The oldest releases `--model` works with (= pyproject.toml's `hf` extra).
FLOORS = {"transformers": "4.54.0", "tokenizers": "0.21.0"}


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: '4.55.0.dev0' → (4, 55, 0), '2.13.0+cpu' →
    (2, 13, 0)."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in found.group(0).split(".")) if found else ()


def checkout_root() -> Path | None:
    """The source checkout attnviz runs from (an editable install, or the repository itself),
    or None for an installed package."""
    root = Path(__file__).resolve().parents[3]
    project = root / "pyproject.toml"
    try:
        is_ours = project.is_file() and 'name = "attnviz"' in project.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return root if is_ours and (root / "attnviz" / "__init__.py").is_file() else None


def install_hint(extra: str = "hf", cwd: Path | None = None) -> str:
    """`pip install -e '.[hf]'` from a checkout (its path when elsewhere); `pip install
    'attnviz[hf]'` for an installed package."""
    root = checkout_root()
    if root is None:
        return f"pip install 'attnviz[{extra}]'"
    here = (cwd or Path.cwd()).resolve()
    where = "." if here == root else str(root)
    return f"pip install -e {shlex.quote(f'{where}[{extra}]')}"


def check_versions(installed: dict[str, str] | None = None) -> None:
    """Refuse a transformers or tokenizers older than the floor, naming both versions.

    installed: name → version, for tests; by default read from the installed packages' metadata
    (nothing is imported)."""
    for name, floor in FLOORS.items():
        try:
            have = (installed or {}).get(name) or importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed at all: require_transformers says which extra to install
        if release(have) < release(floor):
            raise UsageError(f"{option('model')} needs {name} >= {floor}, but {name} {have} is "
                             "installed",
                             fix=f"pip install -U '{name}>={floor}'")
