//! .alloctramp.text: the init, fini, capture (two), vector, wide-size and trace stubs, a static program's
//! entry stub and thread-local image, then every patched site's trampoline (an entry hook's after its
//! stub), each 16-byte aligned, with `int3` between them.

use super::Head;
use crate::plan::Plan;

/// Moves the segment's code into `head`, with `int3` between and after:
/// no copy of it is built (and a trampoline from a template is made as the
/// head is written).
pub(super) fn fill(plan: &mut Plan, head: &mut Head) {
    let (start, end) = (plan.text.offset.0, plan.text.offset.0 + plan.text.size);
    // (A part for each code, and one for each run of int3 before it.)
    let hooks = plan.sites.iter().filter(|s| s.hook.is_some()).count();
    head.reserve(2 * (9 + plan.sites.len() + hooks));
    let stubs = [
        &mut plan.init,
        &mut plan.fini,
        &mut plan.capture,
        &mut plan.capture_plain,
        &mut plan.vectors,
        &mut plan.wide,
        &mut plan.trace,
    ];
    let codes = stubs.into_iter().chain(plan.statics.iter_mut().map(|s| &mut s.entry)).chain(
        plan.sites.iter_mut().flat_map(|s| {
            let (hook, decision) = (&mut s.hook, &mut s.decision);
            hook.as_mut().map(|h| &mut h.stub).into_iter().chain(match decision {
                crate::plan::Decision::Patched(t) => Some(&mut t.code),
                crate::plan::Decision::Skipped(_) => None,
            })
        }),
    );
    let mut at = start;
    for code in codes {
        let (offset, len) = (code.offset.0, code.bytes.len() as u64);
        assert!(offset >= at && offset + len <= end, "code at {offset:#x} out of order or outside the text");
        head.fill(at, offset - at, 0xcc);
        head.put_code(
            crate::plan::Region { offset: code.offset, addr: code.addr, size: len },
            std::mem::take(&mut code.bytes),
        );
        at = offset + len;
    }
    head.fill(at, end - at, 0xcc);
}
