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
    echo "==> creating $VENV" >&2
    "$(find_python)" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
STAMP="$VENV/.installed-$EXTRAS"
if [ ! -f "$STAMP" ] || [ "$ROOT/setup.cfg" -nt "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    echo "==> installing servicebus[$EXTRAS] into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[$EXTRAS]"
    touch "$STAMP"
fi
PY="$VENV/bin/python"

# PySpark (the delivery audit) needs Java 17 or newer. Say clearly when it is missing;
# the rest of servicebus does not need it.
java_status() {
    "$PY" -c 'from servicebus.audit.job import java_problem; import sys; p = java_problem(); print(p or ""); sys.exit(1 if p else 0)'
}

# ensure_debian_packages COMMAND:PACKAGE ...: install the Debian packages whose commands
# are missing, when running as root with apt-get; otherwise say what is missing.
ensure_debian_packages() {
    local missing=() pair
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "==> installing ${missing[*]} (Debian packages) for the fault tests" >&2
        if DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 ||
           { apt-get update -q >/dev/null 2>&1 &&
             DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; }; then
            return 0
        fi
    fi
    echo "WARNING: ${missing[*]} not installed: the fault tests that need them will be skipped" >&2
}
