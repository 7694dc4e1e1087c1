#!/bin/sh
# Runs pytest against the AddressSanitizer + UndefinedBehaviorSanitizer build of the CPU
# kernels (`make sanitize` builds it into build/sanitize/lib with FP8LINEAR_SANITIZE=1):
#   sh scripts/sanitize.sh PYTHON BUILD_LIB [pytest arguments...]
# The in-tree fp8linear/_C*.so is never used: the Python package is copied next to the
# instrumented _C in BUILD_LIB, which goes first on PYTHONPATH, and PYTHONSAFEPATH keeps
# the current directory (the checkout, with its own fp8linear/) off sys.path, also in the
# Python processes that tests start.
set -eu
python=$1
lib=$2
shift 2

extension=$(ls "$lib"/fp8linear/_C*.so 2>/dev/null | head -n 1)
if [ -z "$extension" ]; then
  echo "sanitize: no instrumented build in $lib (run make sanitize)" >&2
  exit 1
fi

# the Python package as it is now, next to the instrumented extension
find "$lib/fp8linear" -name '*.py' -delete
tar -C fp8linear --exclude='*.so' --exclude=__pycache__ -cf - . | tar -C "$lib/fp8linear" -xf -

# The ASan runtime must be the first library loaded (python itself is not instrumented),
# and libstdc++ loaded with it: otherwise ASan can't intercept __cxa_throw, and the first
# C++ exception (any ValueError from the bindings' checks) ends the process silently.
runtime() {  # the library $1 as the instrumented extension links it, else as the compiler names it
  found=$(ldd "$extension" | awk -v name="$1" 'index($1, name) == 1 { print $3; exit }')
  [ -n "$found" ] || found=$(${CXX:-c++} -print-file-name="$1.so")
  if [ ! -f "$found" ]; then
    echo "sanitize: $1 not found (install the compiler's sanitizer runtimes, e.g. libasan8 and libubsan1)" >&2
    exit 1
  fi
  echo "$found"
}
asan=$(runtime libasan)
stdcxx=$(runtime libstdc++)
LD_PRELOAD="$asan $stdcxx"
# detect_leaks=0: python and torch keep memory until exit by design. abort_on_error: the
# first report ends the process with SIGABRT, on which Python's faulthandler (on in
# pytest) prints the Python stack, naming the test.
ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:abort_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
PYTHONPATH="$(cd "$lib" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
PYTHONSAFEPATH=1
FP8LINEAR_SANITIZE_BUILD="$(cd "$lib" && pwd)"
export LD_PRELOAD ASAN_OPTIONS UBSAN_OPTIONS PYTHONPATH PYTHONSAFEPATH FP8LINEAR_SANITIZE_BUILD

# which fp8linear._C is imported (tests/test_sanitize_build.py checks it too)
imported=$("$python" -c "import fp8linear._C as c; print(c.__file__)")
echo "sanitize: testing $imported"
case "$imported" in
  "$FP8LINEAR_SANITIZE_BUILD"/*) ;;
  *) echo "sanitize: imported $imported, not the instrumented build in $FP8LINEAR_SANITIZE_BUILD" >&2; exit 1 ;;
esac
# --capture=sys: pytest captures Python's sys.stdout/stderr only, so that a sanitizer's report,
# written to file descriptor 2 just before the process ends, is not lost with pytest's capture.
exec "$python" -m pytest -p no:cacheprovider --capture=sys "$@"
