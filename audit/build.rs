fn main() {
    static_unwinder();
}

include!("../build-support/static_unwinder.rs");
