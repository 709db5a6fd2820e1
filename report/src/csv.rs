//! Rows as comma-separated values (RFC 4180): a header row, then one row
//! per site or group, with the fields of the JSON rows; unknown values (the
//! JSON nulls) are empty fields.

use crate::json::RowDoc;
use crate::model::{GroupBy, Row};
use std::io::{self, Write};

/// The figures' columns, after the key columns.
const FIGURES: [&str; 9] = [
    "calls",
    "bytes",
    "failed",
    "live_calls",
    "live_bytes",
    "freed_objects",
    "freed_bytes",
    "untracked_frees",
    "injected",
];

/// The columns, per grouping (`diff`: with `in_old` and `in_new`).
pub fn columns(g: GroupBy, diff: bool) -> Vec<&'static str> {
    let mut c: Vec<&str> = match g {
        GroupBy::Site => vec!["module", "build_id", "address", "function", "file", "line", "entry", "kind", "form"],
        GroupBy::Function => vec!["module", "function", "sites"],
        GroupBy::File => vec!["module", "file", "sites"],
        GroupBy::Module => vec!["module", "sites"],
    };
    if diff {
        c.extend(["in_old", "in_new"]);
    }
    c.extend(FIGURES);
    if g != GroupBy::Site {
        c.push("free_calls");
    }
    c
}

fn field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() }
}

/// Writes the header row and one row per row.
pub fn write(w: &mut dyn Write, rows: &[Row], group: GroupBy, diff: bool) -> io::Result<()> {
    let cols = columns(group, diff);
    writeln!(w, "{}", cols.join(","))?;
    let mut line = String::new();
    for r in rows {
        let d = RowDoc::new(r);
        line.clear();
        for (i, c) in cols.iter().enumerate() {
            if i > 0 {
                line.push(',');
            }
            let int = |v: Option<i128>| v.map(|v| v.to_string()).unwrap_or_default();
            let text = |v: Option<&str>| v.map(field).unwrap_or_default();
            let value = match *c {
                "module" => text(d.module),
                "build_id" => text(d.build_id),
                "address" => int(d.address.map(i128::from)),
                "function" => text(d.function.flatten()),
                "file" => text(d.file.flatten()),
                "line" => int(d.line.flatten().map(i128::from)),
                "entry" => text(d.entry),
                "kind" => text(d.kind),
                "form" => text(d.form),
                "sites" => int(d.sites.map(i128::from)),
                "in_old" => d.in_old.map(|b| b.to_string()).unwrap_or_default(),
                "in_new" => d.in_new.map(|b| b.to_string()).unwrap_or_default(),
                "calls" => d.calls.to_string(),
                "bytes" => d.bytes.to_string(),
                "failed" => d.failed.to_string(),
                "live_calls" => int(d.live_calls),
                "live_bytes" => int(d.live_bytes),
                "freed_objects" => d.freed_objects.to_string(),
                "freed_bytes" => d.freed_bytes.to_string(),
                "untracked_frees" => d.untracked_frees.to_string(),
                "injected" => d.injected.to_string(),
                "free_calls" => int(d.free_calls),
                _ => String::new(),
            };
            line.push_str(&value);
        }
        writeln!(w, "{line}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::{figures, site};
    use crate::model::{diff, group};
    use alloctramp_trampolines::entry::Kind;

    fn csv(rows: &[Row], g: GroupBy, diff: bool) -> String {
        let mut v = Vec::new();
        write(&mut v, rows, g, diff).unwrap();
        String::from_utf8(v).unwrap()
    }

    #[test]
    fn sites_with_quoted_names_and_empty_unknowns() {
        let mut f = figures();
        f.sites.truncate(2);
        let mut cxx = site("prog", 0x10, "main", Kind::Alloc);
        cxx.function = Some("std::map<int, \"a\">::insert");
        cxx.entry = "operator new";
        f.sites[0].0 = cxx;
        f.sites[1].0.line = None;
        f.sites[1].0.file = None;
        f.sites[1].1.live_calls = None;
        f.sites[1].1.live_bytes = None;
        let rows = group(f.sites, GroupBy::Site);
        assert_eq!(
            csv(&rows, GroupBy::Site, false),
            "module,build_id,address,function,file,line,entry,kind,form,calls,bytes,failed,live_calls,live_bytes,freed_objects,freed_bytes,untracked_frees,injected\n\
             prog,b1d,16,\"std::map<int, \"\"a\"\">::insert\",main.c,16,operator new,alloc,call rel32,10,160,0,0,0,10,160,0,0\n\
             prog,b1d,32,main,,,malloc,alloc,call rel32,3,3000,0,,,1,1000,0,0\n"
        );
    }

    #[test]
    fn groups_and_differences() {
        let rows = group(figures().sites, GroupBy::Function);
        assert_eq!(
            csv(&rows[..2], GroupBy::Function, false),
            "module,function,sites,calls,bytes,failed,live_calls,live_bytes,freed_objects,freed_bytes,untracked_frees,injected,free_calls\n\
             prog,main,3,13,3160,0,2,2000,11,1160,0,0,11\n\
             prog,work,1,5,500,0,0,0,5,500,0,0,0\n"
        );
        let mut new = figures();
        new.sites.remove(0);
        let rows = diff(&figures(), &new, false).select(&Default::default()).unwrap();
        assert_eq!(
            csv(&rows, GroupBy::Site, true),
            "module,build_id,address,function,file,line,entry,kind,form,in_old,in_new,calls,bytes,failed,live_calls,live_bytes,freed_objects,freed_bytes,untracked_frees,injected\n\
             prog,b1d,16,main,main.c,16,malloc,alloc,call rel32,true,false,-10,-160,0,0,0,-10,-160,0,0\n"
        );
        let rows = diff(&figures(), &new, false)
            .select(&crate::Selection { group_by: GroupBy::Module, ..Default::default() })
            .unwrap();
        assert_eq!(
            csv(&rows, GroupBy::Module, true),
            "module,sites,in_old,in_new,calls,bytes,failed,live_calls,live_bytes,freed_objects,freed_bytes,untracked_frees,injected,free_calls\n\
             prog,1,,,-10,-160,0,0,0,-10,-160,0,0,0\n"
        );
    }
}
