#!/usr/bin/env bash
# The Python tests against the installed wheel, as a user would have it:
#
#   tools/wheel_test.sh VENV TORCH_VERSION JUNIT_DIR [pytest arguments, default tests/py tests/wheel]
#
# Makes the virtual environment VENV with torch==TORCH_VERSION and the tests' packages
# unless its stamp VENV/installed lists them (torch pinned: an unpinned one pulls a
# multi-GB CUDA build); builds the wheel as `pip install .` does (pyproject.toml's
# backend runs bazel build //:wheel) unless $PRECIS_WHEEL names one; installs it in place of any earlier precis and runs pytest from a temporary
# directory with no PYTHONPATH: PRECIS_TEST_INSTALLED=1 tells tests/py/conftest.py to
# leave torch_ext/ off sys.path and to fail if precis comes from the checkout.
# JUnit XML: JUNIT_DIR/test.xml (tools/count_tests.py counts it).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:?usage: tools/wheel_test.sh VENV TORCH_VERSION JUNIT_DIR [pytest arguments]}
version=${2:?torch version}
junit=${3:?JUnit directory}
shift 3
cd "$repo"
# The tests' packages, pinned as in tools/setup.sh.
requirements="torch==$version numpy==2.4.6 pytest==9.2.0 pyyaml==6.0.3 expecttest==0.3.0 \
matplotlib==3.11.2"
[[ -x $venv/bin/python ]] || "${PRECIS_BOOTSTRAP_PYTHON:-python3}" -m venv "$venv"
# The stamp names what was installed: an interrupted install or a new pin is redone.
if [[ "$(cat "$venv/installed" 2>/dev/null)" != "$requirements" ]]; then
  # shellcheck disable=SC2086  # one word per requirement
  "$venv/bin/python" -m pip install -q --disable-pip-version-check $requirements
  echo "$requirements" >"$venv/installed"
fi
venv=$(cd "$venv" && pwd)
wheel=${PRECIS_WHEEL:-}
if [[ -z $wheel ]]; then
  # Built as `pip install .` builds it: pyproject.toml's backend runs bazel build //:wheel.
  rm -rf "$venv/wheelhouse"
  "$venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps \
    -w "$venv/wheelhouse" "$repo"
  wheel=$(ls "$venv"/wheelhouse/precis-*.whl)
fi
wheel=$(readlink -f "$wheel")
"$venv/bin/python" -m pip uninstall -q -y precis 2>/dev/null || true
# torch is there already: the wheel's Requires-Dist (torch>=2.10) downloads nothing.
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel"
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, '+ wheel', '$(basename "$wheel")')"
# Paths are the repository's (made absolute); other arguments go to pytest as they are.
args=()
for a in "$@"; do
  if [[ -e $a ]]; then args+=("$repo/$a"); else args+=("$a"); fi
done
[[ ${#args[@]} -gt 0 ]] || args=("$repo/tests/py" "$repo/tests/wheel")
mkdir -p "$junit"
junit=$(cd "$junit" && pwd)
outside=$(mktemp -d)
trap 'rm -rf "$outside"' EXIT
cd "$outside"
env -u PYTHONPATH -u PRECIS_LIBRARY -u PRECIS_TORCH_LIBRARY -u PRECIS_CUDA_LIBRARY \
  PRECIS_TEST_INSTALLED=1 PRECIS_WHEEL="$wheel" \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider --junitxml="$junit/test.xml" \
  "${args[@]}"
