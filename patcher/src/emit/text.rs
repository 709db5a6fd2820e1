//! .alloctramp.text: the init, fini, capture (two), vector, wide-size and trace stubs, a static program's
//! entry stub and thread-local image, then every patched site's trampoline (an entry hook's after its
//! stub), each 16-byte aligned, with `int3` between them.

use crate::plan::Plan;

/// Writes the segment's code into `text` (its region of the output, which
/// is as large as the plan made it): no copy of it is built.
pub(super) fn fill(plan: &Plan, text: &mut [u8]) {
    text.fill(0xcc);
    let codes = [&plan.init, &plan.fini, &plan.capture, &plan.capture_plain, &plan.vectors, &plan.wide, &plan.trace]
        .into_iter()
        .chain(plan.statics.iter().map(|s| &s.entry))
        .chain(
            plan.sites
                .iter()
                .flat_map(|s| s.hook.as_ref().map(|h| &h.stub).into_iter().chain(s.trampoline().map(|t| &t.code))),
        );
    for code in codes {
        let at = (code.offset.0 - plan.text.offset.0) as usize;
        text[at..at + code.bytes.len()].copy_from_slice(&code.bytes);
    }
}
