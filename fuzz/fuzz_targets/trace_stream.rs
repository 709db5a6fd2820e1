//! Any bytes as a stream file of an event trace (what `alloctramp analyze`
//! reads), and as its metadata: an error naming an offset or events,
//! never a panic; what reads is analysed without panicking either.
#![no_main]

use alloctramp_report::events::{Trace, analyze, read_metadata, read_stream};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = read_metadata(&String::from_utf8_lossy(data));
    match read_stream(data, None) {
        Ok(stream) => {
            let t = Trace::new(vec![stream], 1_000_000_000);
            let a = analyze(&t);
            assert!(a.events as usize == t.events.len());
        }
        Err(e) => assert!(e.offset <= data.len()),
    }
});
