"""The committed stubs are what generate.py makes from proto/ now."""

import importlib.util
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def _generate_module():
    spec = importlib.util.spec_from_file_location("latchkey_generate", ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_protos(tmp_path):
    generate = _generate_module()
    fresh = generate.generate(tmp_path)
    stale = []
    for path in fresh:
        relative = path.relative_to(tmp_path)
        committed = ROOT / "src" / relative
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(relative))
    assert not stale, f"stubs out of date: {stale}; run `python3 clients/python/generate.py`"
