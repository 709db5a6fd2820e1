//! Call chains of sites (callers capture), their frames named: what
//! `report --callers` shows and the pprof profile's stacks are made of.
//! The naming itself (reading the mapped files' symbols and DWARF) is the
//! caller's.

use serde::Serialize;

/// One frame of a chain.
#[derive(Serialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Frame {
    /// Run-time return address.
    pub address: u64,
    /// The file mapped there, and the address in it.
    pub module: Option<String>,
    pub module_address: Option<u64>,
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<u32>,
}

impl Frame {
    /// `function (file:line)`, what is known of it.
    pub fn describe(&self) -> String {
        let name = self.function.clone().unwrap_or_else(|| format!("{:#x}", self.address));
        match (&self.file, self.line, &self.module) {
            (Some(f), Some(l), _) => format!("{name} ({f}:{l})"),
            (_, _, Some(m)) => format!("{name} ({})", base(m)),
            _ => name,
        }
    }
}

fn base(p: &str) -> &str {
    p.rsplit('/').next().unwrap_or(p)
}

/// One chain of one site.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct ChainRow {
    /// The site: its module's name and address, as the report's rows give
    /// them.
    #[serde(skip)]
    pub site: (String, u64),
    pub calls: u64,
    pub bytes: u64,
    /// Innermost first: the return address out of the site's function,
    /// then its caller's, and so on.
    pub frames: Vec<Frame>,
    /// The first frame outside allocation plumbing (an index of
    /// `frames`), when the site is in plumbing (by its function's name or
    /// its source file); null when it is not (the site names the code) or
    /// every frame is.
    pub outside_plumbing: Option<usize>,
}

/// A node of an icicle (a flame graph upside down): a frame, the bytes
/// and calls of the chains through it, and the frames they were called
/// from next.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub name: String,
    pub bytes: u64,
    pub calls: u64,
    pub children: Vec<Node>,
}

impl Node {
    fn child(&mut self, name: String) -> &mut Node {
        let i = match self.children.iter().position(|c| c.name == name) {
            Some(i) => i,
            None => {
                self.children.push(Node { name, bytes: 0, calls: 0, children: Vec::new() });
                self.children.len() - 1
            }
        };
        &mut self.children[i]
    }
}

/// The icicle of the bytes allocated through each recorded chain (since
/// callers capture started, or the last reset; not live bytes: chains
/// count calls and bytes, live figures are per site): from `root`, the
/// outermost frame of each chain, down to the innermost caller and then
/// the site, named by `site_name`. Children are largest first.
pub fn icicle(root: &str, chains: &[ChainRow], site_name: impl Fn(&(String, u64)) -> String) -> Node {
    let mut top = Node { name: root.to_string(), bytes: 0, calls: 0, children: Vec::new() };
    for c in chains {
        top.bytes += c.bytes;
        top.calls += c.calls;
        let mut at = &mut top;
        let names = c.frames.iter().rev().map(Frame::describe).chain(std::iter::once(site_name(&c.site)));
        for name in names {
            at = at.child(name);
            at.bytes += c.bytes;
            at.calls += c.calls;
        }
    }
    fn order(n: &mut Node) {
        n.children.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.name.cmp(&b.name)));
        n.children.iter_mut().for_each(order);
    }
    order(&mut top);
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(function: &str, line: u32) -> Frame {
        Frame {
            address: u64::from(line),
            function: Some(function.to_string()),
            file: Some("c.c".to_string()),
            line: Some(line),
            ..Frame::default()
        }
    }

    fn chain(frames: Vec<Frame>, calls: u64, bytes: u64) -> ChainRow {
        ChainRow { site: ("prog".to_string(), 0x10), calls, bytes, frames, outside_plumbing: None }
    }

    #[test]
    fn the_icicle_goes_from_the_outermost_caller_to_the_site() {
        let chains = [
            chain(vec![frame("a", 5), frame("main", 20)], 2, 96),
            chain(vec![frame("b", 9), frame("main", 21)], 1, 160),
            chain(vec![frame("a", 5), frame("main", 20), frame("_start", 1)], 1, 8),
        ];
        let t = icicle("all", &chains, |s| format!("site {:#x}", s.1));
        assert_eq!((t.name.as_str(), t.bytes, t.calls), ("all", 264, 4));
        let names = |n: &Node| n.children.iter().map(|c| (c.name.clone(), c.bytes)).collect::<Vec<_>>();
        assert_eq!(
            names(&t),
            [("main (c.c:21)".to_string(), 160), ("main (c.c:20)".to_string(), 96), ("_start (c.c:1)".to_string(), 8)]
        );
        let main20 = &t.children[1];
        assert_eq!(names(main20), [("a (c.c:5)".to_string(), 96)]);
        assert_eq!(names(&main20.children[0]), [("site 0x10".to_string(), 96)]);
        assert_eq!(main20.children[0].children[0].calls, 2);
        assert!(main20.children[0].children[0].children.is_empty());
    }
}
