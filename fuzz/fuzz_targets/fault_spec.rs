//! Any bytes as fault injection specs (what `ALLOCTRAMP_FAIL` and a fail
//! file hand the runtime): an error or specs, never a panic; a spec that
//! parses says which of its first calls fail without panicking either.
#![no_main]

use alloctramp_trampolines::fault::{MAX_SPECS, Spec, parse_list};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut specs = [Spec::EMPTY; MAX_SPECS];
    if let Ok(n) = parse_list(data, &mut specs) {
        assert!(n <= MAX_SPECS);
        for s in &specs[..n] {
            assert!(s.text().len() <= alloctramp_trampolines::fault::MAX_WHERE);
            for call in [1, 2, 3, u64::MAX] {
                let _ = s.fails(call);
            }
        }
    }
});
