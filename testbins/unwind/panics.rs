// A panic inside plumbing (format!, collect) caught with catch_unwind: a patched
// Rust program behaves as the original with profiling on (cli/tests/charge.rs).
use std::fmt;
struct Bad(u32);
impl fmt::Display for Bad {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        if self.0 == 7 { panic!("bad display"); }
        write!(f, "{}", self.0)
    }
}
#[inline(never)]
fn mk(n: u32) -> String { format!("{} and {}", Bad(n), n) }
fn main() {
    let n: u32 = std::env::args().count() as u32 + 5;
    let mut total = 0;
    for i in 0..10u32 {
        let r = std::panic::catch_unwind(|| mk(n + i));
        match r { Ok(s) => total += s.len(), Err(_) => println!("caught panic {}", n+i) }
    }
    let r = std::panic::catch_unwind(|| { let v: Vec<u32> = (0..n).map(|x| if x == 3 { panic!("x") } else { x }).collect(); v.len() });
    println!("collect: {:?} total {}", r.is_err(), total);
}
