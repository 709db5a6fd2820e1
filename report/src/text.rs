//! Rows as text in the `/proc/allocinfo` layout: a version line, a header
//! line, then `<size> <calls> <tag>` per row, right-aligned, so that
//! `sort -g -r` orders the rows (`sort -h` with human sizes).

use crate::model::Row;
use std::io::{self, Write};

/// How rows are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Every figure, the kind and the entry point, not only size and calls.
    pub all_columns: bool,
    /// Sizes in B/KiB/MiB/GiB ([`human`]).
    pub human: bool,
    /// The figures are differences: increases get a `+`.
    pub diff: bool,
    /// The kernel's newer layout: `allocinfo - version: 2.0`, and
    /// `key:value` pairs after the tag (`accurate:no` when `inaccurate`).
    pub version2: bool,
    /// The size and calls columns are not exact live figures (no live
    /// tracking, or live figures that may overstate): with `version2`,
    /// every row says `accurate:no`.
    pub inaccurate: bool,
    /// The rows are sorted by a total (`--sort bytes|calls`): the total
    /// bytes and calls come first, then the size and calls columns, so
    /// the column they are sorted by is shown.
    pub totals_first: bool,
}

/// A size as `sort -h` reads it: 1023, 1.0KiB, 12.5MiB.
pub fn human(v: i128) -> String {
    let a = v.unsigned_abs();
    if a < 1024 {
        return v.to_string();
    }
    let units = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut x = a as f64 / 1024.0;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    let sign = if v < 0 { "-" } else { "" };
    format!("{sign}{x:.1}{}", units[u])
}

/// The header line naming the columns.
pub fn header(opts: &Options) -> &'static str {
    if opts.all_columns {
        "#     <size>  <calls> <total-calls>  <total-bytes> <failed>  <freed> <untracked>  <kind> <tag info> entry:<entry>"
    } else if opts.totals_first {
        "#  <total-bytes> <total-calls>       <size>  <calls> <tag info>"
    } else {
        "#     <size>  <calls> <tag info>"
    }
}

/// Writes the version line, the header line and one line per row.
pub fn write(w: &mut dyn Write, rows: &[Row], opts: &Options) -> io::Result<()> {
    let num = |v: i128, bytes: bool| -> String {
        let s = if bytes && opts.human { human(v) } else { v.to_string() };
        if opts.diff && v > 0 { format!("+{s}") } else { s }
    };
    writeln!(w, "allocinfo - version: {}", if opts.version2 { "2.0" } else { "1.0" })?;
    writeln!(w, "{}", header(opts))?;
    let accurate = if opts.version2 && opts.inaccurate { " accurate:no" } else { "" };
    for r in rows {
        let f = &r.fig;
        // Calls failed by fault injection, where there were any.
        let injected = if f.injected != 0 { format!(" injected:{}", num(f.injected, false)) } else { String::new() };
        let pairs = format!("{injected}{accurate}");
        if opts.all_columns {
            let kind = if r.sites == 1 { r.site.kind.as_str().to_string() } else { format!("{}sites", r.sites) };
            let entry = if r.sites == 1 { format!(" entry:{}", r.site.entry) } else { String::new() };
            writeln!(
                w,
                "{:>12} {:>8} {:>13} {:>14} {:>8} {:>8} {:>11} {kind:>7} {}{entry}{pairs}",
                num(f.size(), true),
                num(f.count(), false),
                num(f.calls + f.free_calls, false),
                num(f.bytes, true),
                num(f.failed, false),
                num(f.freed_objects, false),
                num(f.untracked_frees, false),
                r.tag()
            )?;
        } else if opts.totals_first {
            writeln!(
                w,
                "{:>15} {:>13} {:>12} {:>8} {}{pairs}",
                num(f.bytes, true),
                num(f.calls + f.free_calls, false),
                num(f.size(), true),
                num(f.count(), false),
                r.tag()
            )?;
        } else if !opts.diff && !opts.human {
            write!(w, "{:>12} {:>8} ", f.size(), f.count())?;
            r.write_tag(w)?;
            writeln!(w, "{pairs}")?;
        } else {
            writeln!(w, "{:>12} {:>8} {}{pairs}", num(f.size(), true), num(f.count(), false), r.tag())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::figures;
    use crate::model::{GroupBy, diff, group};

    fn text(rows: &[Row], opts: Options) -> String {
        let mut out = Vec::new();
        write(&mut out, rows, &opts).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn sites_in_the_allocinfo_layout() {
        let rows = group(figures().sites, GroupBy::Site);
        assert_eq!(
            text(&rows[..2], Options::default()),
            "allocinfo - version: 1.0\n\
             #     <size>  <calls> <tag info>\n\
             \x20          0        0 main.c:16 module:prog func:main\n\
             \x20       2000        2 main.c:32 module:prog func:main\n"
        );
        let opts = Options { all_columns: true, human: true, ..Options::default() };
        assert_eq!(
            text(&rows[1..3], opts),
            "allocinfo - version: 1.0\n\
             #     <size>  <calls> <total-calls>  <total-bytes> <failed>  <freed> <untracked>  <kind> <tag info> entry:<entry>\n\
             \x20     2.0KiB        2             3         2.9KiB        0        1           0   alloc main.c:32 module:prog func:main entry:malloc\n\
             \x20          0        0            11              0        0        0           0    free main.c:48 module:prog func:main entry:free\n"
        );
    }

    #[test]
    fn groups_and_differences() {
        let rows = group(figures().sites, GroupBy::Module);
        let opts = Options { all_columns: true, ..Options::default() };
        assert_eq!(
            text(&rows, opts),
            "allocinfo - version: 1.0\n\
             #     <size>  <calls> <total-calls>  <total-bytes> <failed>  <freed> <untracked>  <kind> <tag info> entry:<entry>\n\
             \x20       2000        2            29           3660        0       16           0  4sites module:prog\n\
             \x20        448        7             9            448        0        0           2  2sites module:lib.so\n"
        );
        let old = figures();
        let mut new = figures();
        new.sites[1].1.calls += 1;
        new.sites[1].1.bytes += 1000;
        new.sites[1].1.live_calls = Some(3);
        new.sites[1].1.live_bytes = Some(3000);
        new.sites[4].1.live_calls = Some(0);
        new.sites[4].1.live_bytes = Some(0);
        let rows = diff(&old, &new, false).select(&Default::default()).unwrap();
        assert_eq!(
            text(&rows, Options { diff: true, ..Options::default() }),
            "allocinfo - version: 1.0\n\
             #     <size>  <calls> <tag info>\n\
             \x20      +1000       +1 main.c:32 module:prog func:main\n\
             \x20       -448       -7 lib.c:80 module:lib.so func:lib_new\n"
        );
        // Below 1 KiB a human size is the number.
        let human = text(&rows, Options { human: true, diff: true, ..Options::default() });
        assert_eq!(human, text(&rows, Options { diff: true, ..Options::default() }));
    }

    /// The kernel's version 2.0 layout: the header says so, and rows whose
    /// figures are not exact live figures say `accurate:no` after the tag.
    #[test]
    fn allocinfo_version_2_with_accurate_no() {
        let rows = group(figures().sites, GroupBy::Site);
        let v2 = Options { version2: true, ..Options::default() };
        assert_eq!(
            text(&rows[1..2], v2),
            "allocinfo - version: 2.0\n\
             #     <size>  <calls> <tag info>\n\
             \x20       2000        2 main.c:32 module:prog func:main\n"
        );
        assert_eq!(
            text(&rows[1..2], Options { inaccurate: true, ..v2 }),
            "allocinfo - version: 2.0\n\
             #     <size>  <calls> <tag info>\n\
             \x20       2000        2 main.c:32 module:prog func:main accurate:no\n"
        );
        let human = text(&rows[1..2], Options { inaccurate: true, human: true, ..v2 });
        assert!(human.ends_with(" 2 main.c:32 module:prog func:main accurate:no\n"), "{human}");
        assert!(text(&rows[1..2], Options { inaccurate: true, ..Options::default() }).ends_with("func:main\n"));
    }

    /// Sorted by a total: the totals come first, then the live figures.
    #[test]
    fn totals_first_when_sorted_by_a_total() {
        let rows = group(figures().sites, GroupBy::Site);
        assert_eq!(
            text(&rows[1..3], Options { totals_first: true, ..Options::default() }),
            "allocinfo - version: 1.0\n\
             #  <total-bytes> <total-calls>       <size>  <calls> <tag info>\n\
             \x20          3000             3         2000        2 main.c:32 module:prog func:main\n\
             \x20             0            11            0        0 main.c:48 module:prog func:main\n"
        );
    }

    #[test]
    fn human_sizes_read_as_sort_h_reads_them() {
        assert_eq!(human(1023), "1023");
        assert_eq!(human(1024), "1.0KiB");
        assert_eq!(human(-1536), "-1.5KiB");
        assert_eq!(human(12 << 20 | 1 << 19), "12.5MiB");
        assert_eq!(human(i128::from(u64::MAX)), "16.0EiB");
    }
}
