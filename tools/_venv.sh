# Sourced by tools/test and tools/demo: make sure .venv exists and holds the project.
# Creates .venv with the first Python >= 3.11 found, installs the project with the given
# extras, and re-installs only when setup.cfg changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
EXTRAS="${1:-dev}"

find_python() {
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
           "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
            command -v "$candidate"; return 0
        fi
    done
    echo "servicebus needs Python 3.11 or newer; none found on PATH" >&2
    return 1
}

if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV"
    "$(find_python)" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
STAMP="$VENV/.installed-$EXTRAS"
if [ ! -f "$STAMP" ] || [ "$ROOT/setup.cfg" -nt "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    echo "==> installing servicebus[$EXTRAS] into $VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[$EXTRAS]"
    touch "$STAMP"
fi
PY="$VENV/bin/python"

# PySpark (the delivery audit) needs Java 17 or newer. Say clearly when it is missing;
# the rest of servicebus does not need it.
java_status() {
    "$PY" -c 'from servicebus.audit.job import java_problem; import sys; p = java_problem(); print(p or ""); sys.exit(1 if p else 0)'
}
