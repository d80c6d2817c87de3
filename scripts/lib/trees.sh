# The build trees the suites run in, for scripts/test.sh and
# scripts/flake-hunt.sh (sourced, from the top of the checkout).
#   build/        release (cmake's Release)
#   build-asan/   ASan+UBSan    build-tsan/  TSan
#   build-fuzz/   clang, the libFuzzer targets

# -g1 keeps the line tables a sanitizer's report prints, not the variables'
# descriptions; ASan+UBSan at -O1 (ASan's own advice), TSan at -O2. Of
# -O2 -g they take 55% and 75% of the compiler's time.
san_flags() {
    case $1 in address) echo "-O1 -g1 -DNDEBUG" ;; *) echo "-O2 -g1 -DNDEBUG" ;; esac
}

san_dir() {
    case $1 in address) echo build-asan ;; thread) echo build-tsan ;; *) echo "build-$1" ;; esac
}

# Configures DIR with cmake ARGS and builds its TARGET.
build_tree() {
    local dir=$1 target=$2
    shift 2
    cmake -S . -B "$dir" "$@" && cmake --build "$dir" --target "$target" -j"$(nproc)"
}

# Configures and builds the tree of sanitizer SAN (address or thread).
build_san_tree() {
    build_tree "$(san_dir "$1")" all -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQMIGD_SANITIZE="$1" \
        -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$(san_flags "$1")"
}
