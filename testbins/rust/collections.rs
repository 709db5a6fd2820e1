// A Rust program allocating through the standard library (String, Vec,
// HashMap): `cli/tests/charge.rs` builds it with rustc and compares what a
// report charges with and without `patch --no-charge-callers`.
use std::collections::HashMap;
fn main() {
    let mut h: HashMap<String, Vec<u64>> = HashMap::new();
    for i in 0..1000u64 {
        let k = format!("key{i}");
        h.entry(k).or_default().push(i);
    }
    let mut v: Vec<String> = h.keys().cloned().collect();
    v.sort();
    println!("{} {}", h.len(), v.len());
}
