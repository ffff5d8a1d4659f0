"""The FlashInfer signatures our wrapper calls, recorded from the tested release, and how to re-read them.

flashinfer-python cannot be imported on a machine without CUDA (its import pulls cuda-python, tvm-ffi, …), so the
CPU tests bind our calls to these recorded signatures instead (tests/test_vendor_kernels.py). They are read from
the release's own source with `ast` (no import):

    pip install --no-deps --target /tmp/fi flashinfer-python==0.7.4                       # unpack, no import
    python -m backends.cuda.flashinfer_api /tmp/fi > backends/cuda/flashinfer_api.json     # re-record
    python -m backends.cuda.flashinfer_api /tmp/fi --check                                  # compare

`--check` against any flashinfer source tree (an installed site-packages, a git checkout) tells whether a newer
release still takes our calls; the `[cuda]` extra pins the range recorded here (TESTED).
"""
from __future__ import annotations

import ast
import json
import os
import sys

TESTED = ">=0.7.4,<0.8"          # the [cuda] extra's pin (pyproject.toml); the record below is 0.7.4
RECORD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flashinfer_api.json")
# what we call → (file under flashinfer/, class or None, function)
CALLS = {
    "BatchMLAPagedAttentionWrapper": ("mla/_batch_mla/_wrapper.py", "BatchMLAPagedAttentionWrapper", "__init__"),
    "BatchMLAPagedAttentionWrapper.plan": ("mla/_batch_mla/_wrapper.py", "BatchMLAPagedAttentionWrapper", "plan"),
    "BatchMLAPagedAttentionWrapper.run": ("mla/_batch_mla/_wrapper.py", "BatchMLAPagedAttentionWrapper", "run"),
    "MLAPlanMetadata.csr": ("mla/_batch_mla/_contracts.py", "MLAPlanMetadata", "csr"),
    "trtllm_batch_decode_with_kv_cache_mla": ("mla/_core.py", None, "trtllm_batch_decode_with_kv_cache_mla"),
}


def _params(fn: ast.FunctionDef) -> list[list]:
    """[name, kind, default source or None] for each parameter (bound methods drop self / cls)."""
    a = fn.args
    out: list[list] = []
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(pos, defaults)):
        out.append([arg.arg, "posonly" if i < len(a.posonlyargs) else "pos", None if d is None else ast.unparse(d)])
    if a.vararg:
        out.append([a.vararg.arg, "varargs", None])
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append([arg.arg, "kwonly", None if d is None else ast.unparse(d)])
    if a.kwarg:
        out.append([a.kwarg.arg, "varkw", None])
    if out and out[0][0] in ("self", "cls"):
        out = out[1:]
    return out


def _is_overload(fn: ast.FunctionDef) -> bool:
    return any((isinstance(d, ast.Name) and d.id == "overload") or
               (isinstance(d, ast.Attribute) and d.attr == "overload") for d in fn.decorator_list)


def extract(root: str) -> dict:
    """{call: {"overloads": [params…], "impl": params}} from the flashinfer source under `root`."""
    pkg = os.path.join(root, "flashinfer")
    out = {}
    for call, (path, cls, name) in CALLS.items():
        tree = ast.parse(open(os.path.join(pkg, path)).read())
        body = tree.body
        if cls is not None:
            body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        fns = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
        impl = [f for f in fns if not _is_overload(f)]
        out[call] = {"overloads": [_params(f) for f in fns if _is_overload(f)], "impl": _params(impl[-1])}
    version = open(os.path.join(pkg, "_build_meta.py")).read() if os.path.exists(
        os.path.join(pkg, "_build_meta.py")) else ""
    return {"flashinfer_version": _version(root, version), "calls": out}


def _version(root: str, build_meta: str) -> str:
    for name in os.listdir(root):
        if name.startswith("flashinfer_python-") and name.endswith(".dist-info"):
            return name[len("flashinfer_python-"):-len(".dist-info")]
    for line in build_meta.splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    return "unknown"


def load(path: str = RECORD) -> dict:
    with open(path) as f:
        return json.load(f)


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if not os.path.isdir(os.path.join(argv[0], "flashinfer")):
        print(f"error: {argv[0]} holds no flashinfer/ package (give an unpacked wheel, a site-packages or a "
              "git checkout)", file=sys.stderr)
        return 2
    got = extract(argv[0])
    if "--check" in argv:
        want = load()
        diff = [c for c in CALLS if got["calls"][c] != want["calls"][c]]
        print(f"flashinfer {got['flashinfer_version']} vs recorded {want['flashinfer_version']}: "
              + ("same signatures" if not diff else "differs in " + ", ".join(diff)))
        return 1 if diff else 0
    print(dumps(got))
    return 0


def dumps(record: dict) -> str:
    """The record as JSON with one parameter per line (diffs between releases read line by line)."""
    def sig(params):
        return "[\n      " + ",\n      ".join(json.dumps(p) for p in params) + "]"
    calls = []
    for call, v in record["calls"].items():
        over = ",\n     ".join(sig(o) for o in v["overloads"])
        calls.append(f'  {json.dumps(call)}: {{\n    "overloads": [{over}],\n    "impl": {sig(v["impl"])}}}')
    return (f'{{"flashinfer_version": {json.dumps(record["flashinfer_version"])},\n "calls": {{\n'
            + ",\n".join(calls) + "}}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
