# The build trees the suites run in, for scripts/test.sh and
# scripts/flake-hunt.sh (sourced, from the top of the checkout).
#   build/        release (cmake's Release)
#   build-asan/   ASan+UBSan: clang, with the libFuzzer targets, where
#                 clang is (gcc, without them, where not)
#   build-tsan/   TSan (gcc)

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

# Whether the ASan+UBSan tree is clang's, with the fuzz targets and the
# thread-safety analysis in its build: clang and its libFuzzer are there.
asan_is_clang() {
    command -v clang++ >/dev/null 2>&1 \
        && [ -e "$(clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a)" ]
}

# Configures and builds the tree of sanitizer SAN (address or thread). One
# clang tree serves ASan's tests and the fuzz targets: a second full build
# of the same code cost more than all the fuzzing it was for.
build_san_tree() {
    local args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DQMIGD_SANITIZE="$1"
                -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$(san_flags "$1")")
    if [ "$1" = address ] && asan_is_clang; then
        args+=(-DCMAKE_CXX_COMPILER=clang++ -DQMIGD_FUZZ=ON)
    fi
    build_tree "$(san_dir "$1")" all "${args[@]}"
}
