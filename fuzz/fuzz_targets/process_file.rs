//! Any bytes as a process counters file (what `alloctramp report` reads): an
//! error, or a file whose every module and cell can be read.
#![no_main]

use alloctramp_trampolines::process::ProcessFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(pf) = ProcessFile::parse(data) else { return };
    let Ok(modules) = pf.modules() else { return };
    for m in &modules {
        for i in 0..m.table.header.site_count as usize {
            let c = m.cell(i);
            let _ = (c.live_objects(), c.live_bytes());
        }
    }
});
