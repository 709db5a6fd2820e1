//! Allocation plumbing: functions between the code that decides to
//! allocate and the allocator (Rust's `alloc::` and hashbrown machinery,
//! libstdc++'s allocator internals). A site whose innermost inlined
//! functions are plumbing is named after the first inlined caller that is
//! not; a report names a call chain after its first frame that is not.
//!
//! The list is data: glob patterns (`*` matches any text) over demangled
//! names, and (written `file:PATTERN`) over the source file an inlined
//! frame's code is in (the Rust standard library's sources, libstdc++'s
//! headers): a documented default that options extend.

/// The default patterns (docs/user-guide.md lists them).
pub const DEFAULT: &[&str] = &[
    // Rust: the alloc crate (RawVec, finish_grow, Vec and String growth,
    // format), its shims, hashbrown's table growth, drop glue.
    "alloc::*",
    "<alloc::*",
    "<&alloc::*",
    "hashbrown::*",
    "<hashbrown::*",
    "__rust_*",
    "__rdl_*",
    "__rustc::*",
    "core::ptr::drop_in_place*",
    // libstdc++: allocators and their traits, container growth helpers.
    "std::__new_allocator*",
    "__gnu_cxx::new_allocator*",
    "__gnu_cxx::__new_allocator*",
    "std::allocator*",
    "std::allocator_traits*",
    "std::_Vector_base*",
    "std::__allocated_ptr*",
    "std::_Hashtable_alloc*",
    "std::vector<*>::_M_*",
    "std::__cxx11::basic_string<*>::_M_*",
    "std::_Hashtable<*>::_M_*",
    "std::__detail::*",
    "std::_Rb_tree<*>::_M_*",
    "std::deque<*>::_M_*",
    "std::_Deque_base<*>::_M_*",
    "std::__cxx11::list<*>::_M_*",
    "std::__cxx11::_List_base<*>::_M_*",
    "std::__shared_count<*>::__shared_count*",
    "std::_Function_base::_Base_manager<*>::_M_*",
    // Inlined code of the standard libraries' sources: Rust's as rustc
    // records them, libstdc++'s headers.
    "file:/rustc/*/library/*",
    "file:*/include/c++/*",
];

/// A set of plumbing patterns.
#[derive(Clone, Debug)]
pub struct Plumbing {
    names: Vec<String>,
    files: Vec<String>,
}

impl Default for Plumbing {
    fn default() -> Plumbing {
        Plumbing::with(&[])
    }
}

impl Plumbing {
    /// The default patterns and `extra` (`file:PATTERN` for files).
    pub fn with(extra: &[String]) -> Plumbing {
        let mut p = Plumbing { names: Vec::new(), files: Vec::new() };
        for pat in DEFAULT.iter().map(|s| s.to_string()).chain(extra.iter().cloned()) {
            match pat.strip_prefix("file:") {
                Some(f) => p.files.push(f.to_string()),
                None => p.names.push(pat),
            }
        }
        p
    }

    /// Whether a demangled function name is plumbing. A C++ template
    /// function's demangled name starts with its return type (`void
    /// std::vector<int>::_M_realloc_insert<int>(...)`): the name after it
    /// is matched too.
    pub fn matches(&self, name: &str) -> bool {
        let one = |n: &str| self.names.iter().any(|p| glob(p.as_bytes(), n.as_bytes()));
        one(name) || after_return_type(name).any(one)
    }

    /// Whether a frame is: its function's name, or the source file its code
    /// is in.
    pub fn matches_frame(&self, name: Option<&str>, file: Option<&str>) -> bool {
        name.is_some_and(|n| self.matches(n))
            || file.is_some_and(|f| self.files.iter().any(|p| glob(p.as_bytes(), f.as_bytes())))
    }
}

/// The tails of a demangled name after each space outside brackets that
/// comes before its parameter list: where the name may start when a return
/// type comes first (`std::pair<int, bool> std::map<...>::insert(...)`).
fn after_return_type(name: &str) -> impl Iterator<Item = &str> {
    let mut depth = 0i32;
    let mut open = true;
    name.char_indices().filter_map(move |(i, c)| {
        match c {
            '<' | '[' => depth += 1,
            '>' | ']' => depth -= 1,
            '(' if depth == 0 => open = false,
            '(' => depth += 1,
            ')' => depth -= 1,
            ' ' if depth == 0 && open => return Some(&name[i + 1..]),
            _ => {}
        }
        None
    })
}

/// `*` matches any run of bytes; everything else itself.
fn glob(p: &[u8], t: &[u8]) -> bool {
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some(b'*') => {
                star = Some((pi, ti));
                pi += 1;
            }
            Some(&c) if c == t[ti] => {
                pi += 1;
                ti += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    pi = sp + 1;
                    ti = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_demangled_names() {
        let p = Plumbing::default();
        for plumbing in [
            "alloc::raw_vec::RawVecInner<A>::finish_grow",
            "<alloc::vec::Vec<T> as alloc::vec::spec_from_iter_nested::SpecFromIterNested<T,I>>::from_iter",
            "hashbrown::raw::RawTable<T,A>::reserve_rehash",
            "__rustc::__rust_alloc",
            "std::__new_allocator<int>::allocate(unsigned long, void const*)",
            "core::ptr::drop_in_place<alloc::vec::Vec<alloc::string::String>>",
            "void std::vector<int, std::allocator<int> >::_M_realloc_insert<int const&>(__gnu_cxx::__normal_iterator<int*, std::vector<int, std::allocator<int> > >, int const&)",
            "std::pair<std::__detail::_Node_iterator<int, true, false>, bool> std::_Hashtable<int>::_M_insert<int const&>(int const&)",
        ] {
            assert!(p.matches(plumbing), "{plumbing}");
        }
        for user in [
            "collections::main",
            "main",
            "std::vector<int>::push_back(int const&)",
            "parse_args",
            "allocate",
            "operator new(unsigned long)",
            "void make<std::vector<int> >(std::vector<int>&)",
            "void consume(std::vector<int>::_M_x)",
        ] {
            assert!(!p.matches(user), "{user}");
        }
        assert!(Plumbing::with(&["xml_*".into()]).matches("xml_new_node"));
        let rust_std = "/rustc/59807616e1fa2540724bfbac14d7976d7e4a3860/library/std/src/collections/hash/map.rs";
        assert!(p.matches_frame(Some("std::collections::hash::map::HashMap<K,V,S,A>::entry"), Some(rust_std)));
        assert!(p.matches_frame(None, Some("/usr/include/c++/12/bits/stl_vector.h")));
        assert!(!p.matches_frame(Some("collections::main"), Some("/src/collections.rs")));
        assert!(Plumbing::with(&["file:*/vendor/*".into()]).matches_frame(None, Some("/src/vendor/x.c")));
        assert!(glob(b"a*b*c", b"aXXbYYc") && !glob(b"a*b*c", b"aXXbYY") && glob(b"*", b""));
    }
}
