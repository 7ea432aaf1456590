#!/usr/bin/env bash
# Run here (with PyPI) before lending work to the GPU machine, which has no network:
# downloads into .whl/ (ignored by git) the wheels that tools/gpu_check.sh installs
# there when its Python (/opt/torch/.venv/bin/python3: CPython 3.12, x86_64, torch
# 2.11, pytest) lacks them: expecttest (torch.testing._internal imports it),
# pytest-timeout (cuda-tests' and sanitize's limit per test), matplotlib and its
# dependencies (train_llm.py's PNG). Pinned, each without its dependencies (they are
# listed), so nothing else is pulled; about 40 MB, under the device tool's 64 MiB carry.
#
# Then, one device-tool call per stage (a command run in the repository root of a
# copy of the working tree; .whl travels only when named in carry):
#
#   command: tools/gpu_check.sh cuda-tests    carry: [".whl"]
#   command: tools/gpu_check.sh sanitize      carry: [".whl"]
#   command: tools/gpu_check.sh evidence      carry: [".whl"]
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}  # any Python with pip: it only downloads
wheels=(expecttest==0.3.0 pytest-timeout==2.4.0
        matplotlib==3.11.2 numpy==2.5.5 pillow==13.0.0 kiwisolver==1.5.1 contourpy==1.4.0
        cycler==0.12.1 fonttools==4.68.0 pyparsing==3.3.3 python-dateutil==4.0.0
        packaging==26.3 tzdata==2026.6)
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 any)
mkdir -p .whl
status=0
"$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  "${platforms[@]/#/--platform=}" -d .whl "${wheels[@]}" || status=1
# Every pin must have its wheel (pip names files with underscores and lower case).
for w in "${wheels[@]}"; do
  name=${w%%==*} version=${w#*==}
  if ! compgen -G ".whl/${name//-/_}-${version}-*.whl" >/dev/null; then
    echo "gpu_prepare: no wheel for $w in .whl/" >&2
    status=1
  fi
done
du -sh .whl
exit $status
