#!/usr/bin/env bash
# The image stage's Pillow build, run by `make install` after the project's dependencies.
#
#   scripts/image_backend.sh VENV [build]  build (once) and install pillow-simd when possible
#   scripts/image_backend.sh VENV ensure   put the cached pillow-simd wheel back if a later
#                                          pip install replaced it with stock Pillow (no build)
#   scripts/image_backend.sh VENV prebuild only build the wheel into the cache (no install):
#                                          `make install` runs it beside the dependencies'
#                                          pip install, so the ~2 min build overlaps it
#
# pillow-simd ships as an sdist only and installs under the same `PIL` name as Pillow, which
# imagehash, scikit-image and others depend on: any pip run that resolves `pillow` puts stock
# Pillow back. So it goes in last, with --no-deps, from a wheel built once and cached in
# VENV/image-backend/. Stock Pillow (the version pip resolved) is kept beside it in
# VENV/image-backend/stock/ as the reference the tests compare the two builds against.
# Anything that stops the build (no compiler, no headers, not root for apt, a failed build,
# a codec missing) leaves stock Pillow active; the last line says which backend is active.
# PRX_IMAGE_BACKEND=stock skips pillow-simd (and puts stock Pillow back if needed).
set -euo pipefail

VENV=${1:?usage: image_backend.sh VENV [ensure]}
MODE=${2:-build}
[[ "$MODE" == build || "$MODE" == ensure || "$MODE" == prebuild ]] ||
  { echo "image_backend.sh: unknown mode $MODE" >&2; exit 2; }
PY="$VENV/bin/python"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
DIR="$VENV/image-backend"
SIMD_VERSION=12.1.1.post0
# Debian packages for the codecs the pipeline reads: JPEG, PNG (zlib), WebP, TIFF.
APT_PACKAGES=(gcc libjpeg62-turbo-dev zlib1g-dev libwebp-dev libtiff-dev)
HEADERS=(/usr/include/jpeglib.h /usr/include/zlib.h /usr/include/webp/decode.h
         /usr/include/x86_64-linux-gnu/tiffio.h)

say() { echo "image backend: $*" >&2; }
backend() { "$PY" -m prx_assets.stages.images.pil_backend 2>/dev/null || true; }
loaded_dist() { "$PY" -c 'from prx_assets.stages.images import pil_backend as b; print(b.current().name)'; }
stock_version() { cat "$DIR/stock/VERSION" 2>/dev/null || true; }

to_stock() {
  local version
  version=$(stock_version)
  "$VENV/bin/pip" uninstall -q -y pillow-simd >/dev/null 2>&1 || true
  "${PIP[@]}" --force-reinstall --no-deps "pillow${version:+==$version}"
}

save_stock_reference() {
  # Record the stock build pip resolved (before pillow-simd replaces it) and unpack it where
  # a subprocess can put it first on sys.path.
  [[ "$(loaded_dist)" == pillow ]] || return 0
  local version
  version=$("$PY" -c 'import PIL; print(PIL.__version__)')
  [[ "$(stock_version)" == "$version" && -d "$DIR/stock/PIL" ]] && return 0
  rm -rf "$DIR/stock"
  "${PIP[@]}" --no-deps --target "$DIR/stock" "pillow==$version"
  echo "$version" > "$DIR/stock/VERSION"
}

install_wheel() {
  "$VENV/bin/pip" uninstall -q -y pillow >/dev/null 2>&1 || true
  "${PIP[@]}" --no-deps --force-reinstall "$1"
}

have_headers() {
  local h
  for h in "${HEADERS[@]}"; do [[ -e "$h" ]] || return 1; done
  command -v cc >/dev/null
}

apt_headers() {
  have_headers && return 0
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    say "build headers missing and apt-get not usable (need root): ${APT_PACKAGES[*]}"
    return 1
  fi
  say "installing build packages: ${APT_PACKAGES[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${APT_PACKAGES[@]}" >/dev/null
}

build_wheel() {
  local cc="cc"
  # pillow-simd picks its AVX2 paths at compile time; without AVX2 it uses SSE4.
  grep -qw avx2 /proc/cpuinfo && cc="cc -mavx2"
  say "building pillow-simd $SIMD_VERSION with CC='$cc' (about 2 minutes)"
  rm -rf "$DIR/wheel.tmp" && mkdir -p "$DIR/wheel.tmp"
  CC="$cc" "$VENV/bin/pip" wheel -q --disable-pip-version-check --no-deps --no-cache-dir \
    -w "$DIR/wheel.tmp" "pillow-simd==$SIMD_VERSION" > "$DIR/build.log" 2>&1 || return 1
  rm -rf "$DIR/wheel" && mv "$DIR/wheel.tmp" "$DIR/wheel"
}

cached_wheel() { compgen -G "$DIR/wheel/pillow_simd-$SIMD_VERSION-*.whl" | head -n 1 || true; }

check_simd() {
  # The build must load, be the one loaded, and read every codec the pipeline needs.
  [[ "$(loaded_dist)" == pillow-simd ]] && "$PY" -m prx_assets.stages.images.pil_backend >/dev/null
}

mkdir -p "$DIR"
if [[ "$MODE" == prebuild ]]; then
  # Nothing of the project is installed yet: no backend to ask. A failure here is left to
  # the `build` run after the install, which tries again and says why.
  if [[ "${PRX_IMAGE_BACKEND:-}" != stock && -z "$(cached_wheel)" ]]; then
    { apt_headers && build_wheel; } || say "prebuild did not finish; the build step retries"
  fi
  exit 0
fi
if [[ "${PRX_IMAGE_BACKEND:-}" == stock ]]; then
  [[ "$(loaded_dist)" == pillow ]] || to_stock
  say "stock Pillow requested (PRX_IMAGE_BACKEND=stock)"
  backend
  exit 0
fi

save_stock_reference
wheel=$(cached_wheel)
if [[ "$MODE" == ensure ]]; then
  if [[ -n "$wheel" && "$(loaded_dist)" != pillow-simd ]]; then
    say "stock Pillow is loaded (a later pip install?): putting the cached pillow-simd back"
    install_wheel "$wheel"
  fi
  backend
  exit 0
fi

if [[ -z "$wheel" ]]; then
  if apt_headers && build_wheel; then
    wheel=$(cached_wheel)
  else
    say "pillow-simd could not be built (see $DIR/build.log): staying on stock Pillow"
  fi
fi
if [[ -n "$wheel" && "$(loaded_dist)" != pillow-simd ]]; then
  install_wheel "$wheel"
fi
if [[ -n "$wheel" ]] && ! check_simd; then
  say "pillow-simd does not work here (missing codecs?): back to stock Pillow"
  backend
  rm -rf "$DIR/wheel"
  to_stock
fi
backend
