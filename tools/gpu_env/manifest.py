"""The bundle manifest: what the archive holds, how it is cut into parts, and the proof
that the pruned library keeps the original's cubins.

Written by build_bundle.py next to the parts, read by install.py on the GPU machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tools.gpu_env.parts import FileRecord

FORMAT = 1
MANIFEST_NAME = "manifest.json"


class ManifestError(ValueError):
    """The manifest is missing, malformed, or of another format version."""


@dataclass
class Manifest:
    archive: FileRecord
    """The tar archive that the parts reassemble into."""
    parts: list[FileRecord]
    """The archive's parts, in order."""
    wheels: list[FileRecord]
    """Every wheel inside the archive (under ``wheels/``)."""
    install: list[str]
    """pip requirements the installer installs from the bundle's wheels, resolving
    their dependencies against what is installed and the bundle."""
    install_no_deps: list[str]
    """Requirements installed first without their dependencies (nvidia-cudnn-frontend,
    whose CuTe DSL dependency is only used on Blackwell and is not shipped)."""
    build_sdists: list[str]
    """Source distributions in ``wheels/`` that the installer builds into wheels on the
    GPU machine before installing (empty when the bundle holds the built wheel)."""
    packages: dict[str, str]
    """Pinned versions of the inputs (distribution name -> version)."""
    pruned_library: dict = field(default_factory=dict)
    """The pruned library: path inside its wheel, sha256 before and after, kept
    architectures, entry counts, and the sha256 of each kept cubin."""
    unresolved_symbols: list[str] = field(default_factory=list)
    """``soname:symbol`` the core library needs that torch's CUDA wheels lack (bundled
    with --allow-unresolved-symbols; the GPU machine must hold newer libraries)."""
    import_check: str = "import transformer_engine.pytorch"
    """Python code the installer runs last."""
    format: int = FORMAT

    def to_json(self) -> dict:
        return {
            "format": self.format,
            "archive": self.archive.to_json(),
            "parts": [p.to_json() for p in self.parts],
            "wheels": [w.to_json() for w in self.wheels],
            "install": list(self.install),
            "install_no_deps": list(self.install_no_deps),
            "build_sdists": list(self.build_sdists),
            "packages": dict(self.packages),
            "pruned_library": self.pruned_library,
            "unresolved_symbols": list(self.unresolved_symbols),
            "import_check": self.import_check,
        }

    @classmethod
    def from_json(cls, obj: dict) -> "Manifest":
        if not isinstance(obj, dict):
            raise ManifestError("manifest is not a JSON object")
        if obj.get("format") != FORMAT:
            raise ManifestError(
                f"manifest format {obj.get('format')!r} is not {FORMAT}: rebuild the bundle with this tool's version"
            )
        try:
            return cls(
                archive=FileRecord.from_json(obj["archive"]),
                parts=[FileRecord.from_json(p) for p in obj["parts"]],
                wheels=[FileRecord.from_json(w) for w in obj["wheels"]],
                install=[str(r) for r in obj["install"]],
                install_no_deps=[str(r) for r in obj["install_no_deps"]],
                build_sdists=[str(r) for r in obj["build_sdists"]],
                packages={str(k): str(v) for k, v in obj["packages"].items()},
                pruned_library=dict(obj.get("pruned_library", {})),
                unresolved_symbols=[str(s) for s in obj.get("unresolved_symbols", [])],
                import_check=str(obj.get("import_check", "import transformer_engine.pytorch")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"manifest is malformed ({type(e).__name__}: {e})") from e

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n")

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        path = Path(path)
        if not path.is_file():
            raise ManifestError(f"no manifest at {path}: pass the bundle folder that holds {MANIFEST_NAME}")
        try:
            obj = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path} is not valid JSON: {e}") from e
        return cls.from_json(obj)
