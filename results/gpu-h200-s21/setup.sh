export PYTHONUNBUFFERED=1
G=.gpu; S=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target $S $G/*.whl 2>&1 | grep -v WARNING
tar xJf $G/fi.tar.xz -C $S && tar xJf $G/fi-src.tar.xz -C $S && tar xJf $G/mpich-slim.tar.xz -C /tmp
export PYTHONPATH=$S:$PWD PATH=/tmp/mpich-slim/bin:$PATH MPI4PY_LIBMPI=/tmp/mpich-slim/lib/libmpi.so.12
export FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=16
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
