//! .alloctramp.sites: the site table (format in `trampolines::layout`).

use crate::Analysis;
use crate::elf::Elf;
use crate::plan::Plan;
use alloctramp_trampolines::layout;

pub(super) fn table(elf: &Elf, a: &Analysis, plan: &Plan) -> Vec<u8> {
    let s = &plan.strings;
    let build_id = elf.build_id().unwrap_or(&[]);
    let id_len = build_id.len().min(20);
    let mut id = [0u8; 20];
    id[..id_len].copy_from_slice(&build_id[..id_len]);
    let header = layout::Header {
        flags: layout::flags::PRESERVE_DIRECT
            | if elf.is_rust_program() { layout::flags::DEFAULT_SEGV_AT_START } else { 0 },
        shard_count: plan.counters.shards,
        shard_stride: plan.counters.stride,
        table_addr: plan.site_table.addr.0,
        control_addr: plan.control.addr.0,
        counters_addr: plan.counters.region.addr.0,
        counters_size: plan.counters.region.size,
        text_addr: plan.text.addr.0,
        text_size: plan.text.size,
        module_name: s.module,
        build_id: id,
        build_id_len: id_len as u32,
        ehdr_addr: plan.ehdr.addr.0,
        ..layout::Header::default()
    };
    let sites: Vec<layout::Site> = plan
        .sites
        .iter()
        .zip(&s.sites)
        .map(|(site, &(function, file, line))| {
            let mut original = [0u8; 8];
            // An entry hook's site is the jump to its stub that the patched
            // file holds.
            let orig = match &site.hook {
                Some(h) => h.jump.1.get(..site.len as usize).unwrap_or(&[]),
                None => site.original.get(..usize::from(site.len)).unwrap_or(&site.original),
            };
            let n = orig.len().min(8);
            original[..n].copy_from_slice(&orig[..n]);
            // A site that is not patched stays in the table for the report,
            // without a trampoline: the runtime never rewrites it.
            let (trampoline, drain, count, callers, traced, flags) = site
                .trampoline()
                .map_or((0, 0, 0, 0, 0, 0), |t| (t.code.addr.0, t.drain, t.count, t.callers, t.traced, t.flags));
            layout::Site {
                addr: site.addr.0,
                trampoline,
                original,
                len: site.len,
                form: site.form as u8,
                entry: s.entry_slot.get(site.entry).copied().unwrap_or(u16::MAX),
                function,
                file,
                line,
                drain,
                count,
                callers,
                flags,
                traced,
                ..layout::Site::default()
            }
        })
        .collect();
    let entries: Vec<layout::Entry> = s
        .table_entries
        .iter()
        .zip(&s.entries)
        .map(|(&i, &name)| (i, &a.scan.entries[i], name))
        .map(|(i, en, name)| layout::Entry {
            name,
            kind: en.sig.kind.code(),
            sig: layout::encode_sig(&en.sig),
            // Entries past the defaults and the user's are the wrappers
            // charging found, but for the slots an allocator API calls its
            // allocator through (`crate::slots`): a call through one is an
            // allocator's call, which a fault fails itself.
            flags: if i >= a.scan.user.end && !a.scan.is_slot(i) { layout::entry_flags::WRAPPER } else { 0 },
            ..layout::Entry::default()
        })
        .collect();
    layout::encode_with_unwind(header, &sites, &entries, &s.strings, &a.unwind, &plan.foreign_unwind)
}
