//! Any bytes as a process counters file, through everything `alloctramp
//! report` does with one (its shared site tables read in first): an error, or figures that group, sort, total,
//! diff and write in every format (pprof and OpenMetrics too) without a panic, and the call chains and
//! mappings of its callers region.
#![no_main]

use alloctramp_report::model::{GroupBy, Selection, SortKey, diff, select};
use alloctramp_report::openmetrics::{self, Scrape, Variant};
use alloctramp_report::{csv, json, pprof, read, text};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The shared site tables a file names, read in from its own last bytes
    // (bytes whose id is not the table's stay out).
    // Slot 0 names the table of those bytes, so that some are read in.
    use alloctramp_trampolines::process;
    let mut data = data.to_vec();
    let slot = process::MODULE_SLOTS_AT as usize;
    let size = data.get(slot + 8..slot + 16).map_or(0, |s| u64::from_le_bytes(s.try_into().unwrap()));
    let tail =
        data.get(data.len().saturating_sub(usize::try_from(size).unwrap_or(usize::MAX))..).unwrap_or(&[]).to_vec();
    if let Some(id) = data.get_mut(slot + 56..slot + 64) {
        id.copy_from_slice(&process::table_id(&tail).to_le_bytes());
    }
    process::read_in_shared_tables(&mut data, |_, size| {
        tail.get(tail.len().saturating_sub(usize::try_from(size).unwrap_or(usize::MAX))..).map(<[u8]>::to_vec)
    });
    let Ok(copy) = read::consistent_copy(&data) else { return };
    let Ok(pf) = read::parse(&copy) else { return };
    // The callers region: chains and mappings, whatever the header says.
    let chains = pf.chains();
    assert!(chains.iter().all(|c| c.frames.len() <= 8 && !c.frames.contains(&0)));
    let _ = pf.maps();
    let Ok(figs) = read::figures(&pf) else { return };
    let live = figs.live();
    for (group_by, sort) in
        [(GroupBy::Site, Some(SortKey::LiveBytes)), (GroupBy::Function, Some(SortKey::Calls)), (GroupBy::Module, None)]
    {
        let sel = Selection { group_by, sort, top: Some(50), ..Selection::default() };
        let Ok(rows) = select(figs.sites.clone(), &figs.modules, &sel, false) else { return };
        let mut out = Vec::new();
        // Every layout: all columns, and the totals first (sorted by a total).
        let totals_first = group_by == GroupBy::Function;
        let opts = text::Options {
            all_columns: !totals_first,
            human: true,
            version2: true,
            inaccurate: !live,
            diff: false,
            totals_first,
        };
        text::write(&mut out, &rows, &opts).unwrap();
        csv::write(&mut out, &rows, group_by, false).unwrap();
        let doc = json::ProcessDoc::new("fuzz", false, &figs.process, &figs.modules);
        json::write_report(&mut out, &doc, &rows, group_by, sort).unwrap();
        let _ = alloctramp_report::model::totals(&rows, live);
    }
    let _ = diff(&figs, &figs, true);
    // pprof and the metrics of a scrape.
    let maps: Vec<pprof::Mapped> = pf
        .maps()
        .into_iter()
        .map(|m| pprof::Mapped { start: m.start, end: m.end, offset: m.offset, path: m.path })
        .collect();
    let _ = pprof::write(&figs, &pprof::Extra { maps: &maps, ..pprof::Extra::default() });
    for (group_by, variant) in [(GroupBy::Site, Variant::OpenMetrics), (GroupBy::Function, Variant::Text)] {
        let scrape = Scrape { processes: vec![figs.clone()], unreadable: 1 };
        openmetrics::write(&mut Vec::new(), &scrape, group_by, variant).unwrap();
    }
});
