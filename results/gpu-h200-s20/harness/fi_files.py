import sys, os
import flashinfer.mla as fm
from flashinfer.mla._batch_mla._backends import fa3_backend, fa2_backend, _fa_common
root = os.path.dirname(sys.modules["flashinfer"].__file__)
files = set()
for k, m in list(sys.modules.items()):
    f = getattr(m, "__file__", None)
    if f and f.startswith(root):
        files.add(os.path.relpath(f, root))
open("/tmp/fi_used.txt", "w").write("\n".join(sorted(files)))
print(len(files), sum(os.path.getsize(os.path.join(root, f)) for f in files))
