fn main() {
    let path = std::env::args().nth(1).unwrap();
    let data = std::fs::read(&path).unwrap();
    let elf = alloctramp_patcher::Elf::parse(&data).unwrap();
    let t = std::time::Instant::now();
    let (w, nr) = alloctramp_patcher::wrappers::discover(&elf, &alloctramp_trampolines::entry::defaults());
    let names: std::collections::HashMap<u64, &str> =
        elf.symbols(false).iter().chain(elf.symbols(true)).filter(|s| s.defined).map(|s| (s.value, s.name)).collect();
    for x in &w {
        println!(
            "{:#x} {:?} d{} {:?} {}",
            x.start,
            x.role,
            x.depth,
            x.why,
            alloctramp_patcher::symbols::demangle(names.get(&x.start).copied().unwrap_or("?"))
        );
    }
    println!(
        "{} wrappers, {} noreturn, {} functions, {:?}",
        w.len(),
        nr.len(),
        alloctramp_patcher::wrappers::functions(&elf).len(),
        t.elapsed()
    );
}
