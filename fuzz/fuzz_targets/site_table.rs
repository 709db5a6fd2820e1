//! Any bytes as a site table (what the runtime and the report read from a
//! module or a process file): an error, or a table whose every site,
//! entry and string can be read.
#![no_main]

use alloctramp_trampolines::layout::Table;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = Table::parse_size(data);
    let Ok(t) = Table::parse(data) else { return };
    for s in t.sites() {
        let _ = t.entry(s.entry as usize);
    }
    let _ = t.module_name();
});
