// static/exact.rs: a Rust program linked statically with glibc
// (`rustc -O -g -C target-feature=+crt-static`: a static-pie), built and
// checked by cli/tests/statics.rs. `keep` makes a vector (one allocation)
// of boxes of 40 bytes (one each), on the main thread (1,000) and on four
// threads (250 to 253); `churn` makes and drops 500 vectors of 24 bytes.
// Everything is freed by the end of `main`.
use std::hint::black_box;

#[inline(never)]
fn keep(n: usize) -> Vec<Box<[u8; 40]>> {
    (0..n).map(|i| Box::new([i as u8; 40])).collect()
}

#[inline(never)]
fn churn(n: usize) -> u64 {
    let mut sum = 0u64;
    for i in 0..n {
        let s = black_box(vec![i as u8; 24]);
        sum += u64::from(s[0]);
    }
    sum
}

fn main() {
    let kept = keep(1000);
    let handles: Vec<_> = (0..4).map(|t| std::thread::spawn(move || keep(250 + t))).collect();
    let more: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let sum = churn(500);
    println!("static rust: {} {} {}", kept.len(), more.iter().map(Vec::len).sum::<usize>(), sum);
}
