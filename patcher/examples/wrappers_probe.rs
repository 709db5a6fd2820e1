fn main() {
    let path = std::env::args().nth(1).unwrap();
    let data = std::fs::read(&path).unwrap();
    let elf = alloctramp_patcher::Elf::parse(&data).unwrap();
    let t = std::time::Instant::now();
    let libs = alloctramp_patcher::deps::libraries(std::path::Path::new(&path), &elf);
    let e = alloctramp_trampolines::entry::defaults();
    let mut imported = std::collections::HashMap::new();
    for l in &libs {
        let d = std::fs::read(l).unwrap();
        let le = alloctramp_patcher::Elf::parse(&d).unwrap();
        let x = alloctramp_patcher::wrappers::exported(&le, &e, &imported);
        eprintln!(
            "{} {} exported wrappers: {:?}",
            l.display(),
            x.len(),
            x.iter().map(|(n, c)| format!("{n}:{c:?}")).collect::<Vec<_>>()
        );
        imported.extend(x);
    }
    let (w, nr) = alloctramp_patcher::wrappers::discover(&elf, &e, &imported);
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
