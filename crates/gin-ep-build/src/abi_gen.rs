//! The kernel ABI generator: reads the headers of a kernel tree's abi/ folder (the host/device
//! argument structs and the constants both sides share) and writes their Rust form
//! (`OUT_DIR/abi.rs`: gin-ep's src/backend/cuda/abi.rs, gin-ep-lab's src/abi.rs) and the C
//! layout checks the kernel build includes (`OUT_DIR/abi_checks.h`).
//!
//! Owns: the header subset (documented at the head of kernels/abi/common.h), its Rust
//! spelling, and the layout of each struct, computed here from naturally aligned fixed-width
//! fields with no implicit padding. Both outputs assert that layout: rustc checks the Rust
//! structs against it, nvcc checks the kernels' structs against it, so the two sides agree.
//! Never: accepts a form outside the subset (an error names file, line and what it found), or
//! evaluates anything it cannot range-check against the declared type.
//!
//! Used by the build scripts through [`crate::generate_abi`]; its tests are this crate's.

use std::collections::HashMap;
use std::fmt::Write as _;

/// What the headers define, in the order read.
#[derive(Default)]
pub struct Abi {
    modules: Vec<Module>,
    /// Every constant (enumerators included) of every header read so far, by qualified C
    /// name (`gin_ep::ll::kMaxGrid`).
    values: HashMap<String, i128>,
    /// The namespaces open where the reader is.
    scope: Vec<String>,
    /// The headers read so far (`abi/ll.h`), which later ones may include.
    files: Vec<String>,
}

struct Module {
    /// `ll` for kernels/abi/ll.h.
    name: String,
    /// The kernel tree the header lies in, relative to the workspace (`kernels`), for the
    /// generated comments and messages.
    root: String,
    file: String,
    /// Whether the outputs carry it: a header another crate generates (read only for what it
    /// defines, e.g. gin-ep's abi/fabric.h under the lab's headers) is not emitted twice.
    emit: bool,
    items: Vec<Item>,
}

enum Item {
    Const {
        comments: Vec<String>,
        name: String,
        ty: Int,
        value: i128,
    },
    Struct(Struct),
}

struct Struct {
    comments: Vec<String>,
    /// C++ path, `gin_ep::ll::LlArgs`.
    path: String,
    name: String,
    line: usize,
    fields: Vec<Field>,
    size: usize,
    align: usize,
}

struct Field {
    comments: Vec<String>,
    name: String,
    kind: Kind,
    offset: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Int {
    I32,
    U32,
    I64,
    U64,
    Usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Int(Int),
    /// Any `T*`: a device (or host-mapped) address, `u64` on the host.
    Addr,
    /// `ncclWindow_t`.
    Window,
    /// The `ncclDevComm` union: `kDevCommSlotBytes` bytes, 8-aligned.
    DevComm,
}

impl Int {
    fn parse(name: &str) -> Option<Int> {
        Some(match name {
            "int" | "int32_t" => Int::I32,
            "uint32_t" => Int::U32,
            "int64_t" => Int::I64,
            "uint64_t" => Int::U64,
            "size_t" => Int::Usize,
            _ => return None,
        })
    }
    fn rust(self) -> &'static str {
        match self {
            Int::I32 => "i32",
            Int::U32 => "u32",
            Int::I64 => "i64",
            Int::U64 => "u64",
            Int::Usize => "usize",
        }
    }
    fn bytes(self) -> usize {
        match self {
            Int::I32 | Int::U32 => 4,
            Int::I64 | Int::U64 | Int::Usize => 8,
        }
    }
    fn range(self) -> (i128, i128) {
        match self {
            Int::I32 => (i32::MIN.into(), i32::MAX.into()),
            Int::U32 => (0, u32::MAX.into()),
            Int::I64 => (i64::MIN.into(), i64::MAX.into()),
            Int::U64 | Int::Usize => (0, u64::MAX.into()),
        }
    }
}

/// The qualified C name of the devcomm slot size (abi/common.h), which must be known before a
/// struct embeds the slot.
const SLOT_BYTES: &str = "gin_ep::kDevCommSlotBytes";

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Num(String),
    Punct(&'static str),
}

struct Lexed {
    toks: Vec<(Tok, usize)>,
    /// Own-line comments, by line: copied before the next item.
    comments: Vec<(usize, String)>,
}

impl Abi {
    pub fn new() -> Abi {
        Abi::default()
    }

    /// Reads one header of kernels/ (`file` is its path there, for messages and `#include`s).
    pub fn read(&mut self, file: &str, src: &str) -> Result<(), String> {
        self.read_in("kernels", file, src, true)
    }

    /// Reads one header of the kernel tree `root`; `emit: false` takes in its definitions (for
    /// the headers after it) without writing it out.
    pub fn read_in(&mut self, root: &str, file: &str, src: &str, emit: bool) -> Result<(), String> {
        let name = file
            .strip_prefix("abi/")
            .and_then(|f| f.strip_suffix(".h"))
            .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .ok_or_else(|| format!("{file}: ABI headers are abi/<lowercase name>.h"))?
            .to_string();
        let lexed = self.lex(file, src)?;
        let mut p = Parser {
            file,
            toks: &lexed.toks,
            at: 0,
            comments: &lexed.comments,
            next_comment: 0,
            last_line: src.lines().count(),
        };
        let mut module = Module {
            name,
            root: root.to_string(),
            file: file.to_string(),
            emit,
            items: Vec::new(),
        };
        self.scope.clear();
        while let Some((tok, line)) = p.peek() {
            let namespaces = self.scope.clone();
            match tok {
                Tok::Ident(w) if w == "namespace" => {
                    p.bump();
                    let ns = p.ident("a namespace name")?;
                    p.punct("{")?;
                    self.scope.push(ns);
                    // Comments before the first namespace are the file's own head.
                    p.take_comments(line + 1);
                }
                Tok::Punct("}") => {
                    p.bump();
                    if self.scope.pop().is_none() {
                        return Err(format!("{file}:{line}: `}}` closes no namespace"));
                    }
                }
                Tok::Ident(w) if namespaces.is_empty() && ["static", "enum"].contains(&w.as_str()) => {
                    // A global constant would be a name of every kernel in the one TU. (A struct
                    // may be global: some were, and their names are in the kernels' symbols.)
                    return Err(format!("{file}:{line}: `{w}` outside a namespace"));
                }
                Tok::Ident(w) if w == "static" => {
                    let comments = p.take_comments(line);
                    self.constants(&mut p, &mut module, comments)?;
                }
                Tok::Ident(w) if w == "enum" => {
                    let comments = p.take_comments(line);
                    self.enumeration(&mut p, &mut module, comments)?;
                }
                Tok::Ident(w) if w == "struct" => {
                    let comments = p.take_comments(line);
                    let s = self.structure(&mut p, &namespaces, comments)?;
                    module.items.push(Item::Struct(s));
                }
                _ => {
                    return Err(format!(
                        "{file}:{line}: expected `namespace`, `static const`, `enum` or `struct`, found {}",
                        show(&tok)
                    ))
                }
            }
        }
        if let Some(ns) = self.scope.last() {
            return Err(format!("{file}: namespace {ns} is not closed"));
        }
        let mut seen: HashMap<String, String> = HashMap::new();
        for item in &module.items {
            let (c, rust) = match item {
                Item::Const { name, .. } => (name.clone(), rust_const(name)),
                Item::Struct(s) => (s.name.clone(), s.name.clone()),
            };
            if let Some(prev) = seen.insert(rust.clone(), c.clone()) {
                return Err(format!("{file}: {prev} and {c} are both {rust} in Rust"));
            }
        }
        self.files.push(file.to_string());
        self.modules.push(module);
        Ok(())
    }

    /// Comments, preprocessor lines and tokens; refuses what the subset has no use for.
    fn lex(&self, file: &str, src: &str) -> Result<Lexed, String> {
        let mut out = Lexed {
            toks: Vec::new(),
            comments: Vec::new(),
        };
        for (i, raw) in src.lines().enumerate() {
            let line = i + 1;
            let (code, comment) = match raw.find("//") {
                Some(at) => (&raw[..at], Some(raw[at + 2..].trim_end())),
                None => (raw, None),
            };
            let code = code.trim();
            if code.is_empty() {
                if let Some(c) = comment {
                    out.comments
                        .push((line, c.strip_prefix(' ').unwrap_or(c).to_string()));
                }
                continue;
            }
            if code.contains("/*") || code.contains('"') && !code.starts_with("#include") {
                return Err(format!(
                    "{file}:{line}: only `//` comments and no strings: {code}"
                ));
            }
            if let Some(directive) = code.strip_prefix('#') {
                let directive = directive.trim();
                let ok = directive == "pragma once"
                    || directive == "include <stdint.h>"
                    || directive == "include <stddef.h>"
                    || directive
                        .strip_prefix("include \"")
                        .and_then(|r| r.strip_suffix('"'))
                        .is_some_and(|inc| self.files.iter().any(|f| f == inc));
                if !ok {
                    return Err(format!(
                        "{file}:{line}: `#{directive}`: only `#pragma once`, `#include <stdint.h>`, \
                         `<stddef.h>` or an ABI header read before this one"
                    ));
                }
                continue;
            }
            let b = code.as_bytes();
            let mut j = 0;
            while j < b.len() {
                let c = b[j] as char;
                if c.is_whitespace() {
                    j += 1;
                } else if c.is_ascii_alphabetic() || c == '_' {
                    // A qualified name (`gin_ep::FabricError`) is one token.
                    let start = j;
                    while j < b.len()
                        && (b[j].is_ascii_alphanumeric()
                            || b[j] == b'_'
                            || code[j..].starts_with("::") && j > start)
                    {
                        j += if b[j] == b':' { 2 } else { 1 };
                    }
                    out.toks.push((Tok::Ident(code[start..j].to_string()), line));
                } else if c.is_ascii_digit() {
                    let start = j;
                    while j < b.len() && b[j].is_ascii_alphanumeric() {
                        j += 1;
                    }
                    out.toks.push((Tok::Num(code[start..j].to_string()), line));
                } else if code[j..].starts_with("<<") {
                    out.toks.push((Tok::Punct("<<"), line));
                    j += 2;
                } else {
                    const PUNCT: [&str; 13] =
                        ["{", "}", "(", ")", ";", ",", "=", "*", ":", "+", "-", "/", "|"];
                    let p = PUNCT
                        .iter()
                        .find(|p| p.as_bytes()[0] == b[j])
                        .ok_or_else(|| format!("{file}:{line}: unexpected `{c}`"))?;
                    out.toks.push((Tok::Punct(p), line));
                    j += 1;
                }
            }
        }
        Ok(out)
    }

    /// `static const T kA = EXPR, kB = EXPR;`
    fn constants(
        &mut self,
        p: &mut Parser,
        module: &mut Module,
        mut comments: Vec<String>,
    ) -> Result<(), String> {
        p.keyword("static")?;
        p.keyword("const")?;
        let ty = p.int_type()?;
        loop {
            let (name, line) = p.const_name()?;
            p.punct("=")?;
            let value = self.expr(p)?;
            self.define(p.file, line, &name, ty, value)?;
            module.items.push(Item::Const {
                comments: std::mem::take(&mut comments),
                name,
                ty,
                value,
            });
            if p.eat(",") {
                continue;
            }
            return p.punct(";");
        }
    }

    /// `enum Name : T { kA = EXPR, ... };` (every enumerator valued).
    fn enumeration(
        &mut self,
        p: &mut Parser,
        module: &mut Module,
        mut enum_comments: Vec<String>,
    ) -> Result<(), String> {
        p.keyword("enum")?;
        let name = p.ident("an enum name")?;
        p.punct(":")?;
        let ty = p.int_type()?;
        p.punct("{")?;
        let mut first = true;
        while !p.eat("}") {
            let comments = p.take_comments(p.line());
            let (c, line) = p.const_name()?;
            p.punct("=")?;
            let value = self.expr(p)?;
            self.define(p.file, line, &c, ty, value)?;
            let comments = if first {
                first = false;
                let mut head = std::mem::take(&mut enum_comments);
                head.push(format!("enum {name} : {}", rust_c_type(ty)));
                head.extend(comments);
                head
            } else {
                comments
            };
            module.items.push(Item::Const {
                comments,
                name: c,
                ty,
                value,
            });
            if !p.eat(",") {
                p.punct("}")?;
                break;
            }
        }
        p.punct(";")
    }

    /// `struct Name { fields };`
    fn structure(
        &mut self,
        p: &mut Parser,
        namespaces: &[String],
        comments: Vec<String>,
    ) -> Result<Struct, String> {
        let line = p.line();
        p.keyword("struct")?;
        let name = p.ident("a struct name")?;
        if name.contains(':') {
            return Err(format!("{}:{line}: struct name `{name}`", p.file));
        }
        p.punct("{")?;
        let mut fields: Vec<Field> = Vec::new();
        let (mut offset, mut align) = (0usize, 1usize);
        while !p.eat("}") {
            let fline = p.line();
            let comments = p.take_comments(fline);
            let (kind, fname) = if p.eat_keyword("union") {
                if !fields.is_empty() {
                    return Err(format!(
                        "{}:{fline}: the devcomm union must be the first field",
                        p.file
                    ));
                }
                if !self.values.contains_key(SLOT_BYTES) {
                    return Err(format!(
                        "{}:{fline}: the devcomm union needs {SLOT_BYTES} (abi/common.h) read first",
                        p.file
                    ));
                }
                for want in [
                    "{",
                    "ncclDevComm",
                    "comm",
                    ";",
                    "DevCommSlot",
                    "comm_slot",
                    ";",
                    "}",
                    ";",
                ] {
                    // Outside namespace gin_ep the slot is spelt with it.
                    if want == "DevCommSlot" && p.eat_keyword("gin_ep::DevCommSlot") {
                        continue;
                    }
                    p.expect_text(
                        want,
                        "the devcomm union `union { ncclDevComm comm; DevCommSlot comm_slot; };`",
                    )?;
                }
                (Kind::DevComm, "comm".to_string())
            } else {
                let had_const = p.eat_keyword("const");
                let ty = p.ident("a field type")?;
                let kind = if p.eat("*") {
                    Kind::Addr
                } else if had_const {
                    return Err(format!("{}:{fline}: `const` only on pointer fields", p.file));
                } else if ty == "ncclWindow_t" {
                    Kind::Window
                } else if ty == "unsigned" {
                    // `unsigned long long` (what atomicAdd takes), 64 bits where the kernels run.
                    p.keyword("long")?;
                    p.keyword("long")?;
                    Kind::Int(Int::U64)
                } else {
                    Kind::Int(Int::parse(&ty).ok_or_else(|| {
                        format!(
                            "{}:{fline}: field type `{ty}`: only int, int32_t, uint32_t, int64_t, uint64_t, \
                             unsigned long long, size_t, T* or ncclWindow_t",
                            p.file
                        )
                    })?)
                };
                let fname = p.ident("a field name")?;
                if fname.contains(':') {
                    return Err(format!("{}:{fline}: field name `{fname}`", p.file));
                }
                p.punct(";")?;
                (kind, fname)
            };
            let (size, falign) = match kind {
                Kind::Int(i) => (i.bytes(), i.bytes()),
                Kind::Addr | Kind::Window => (8, 8),
                Kind::DevComm => (self.values[SLOT_BYTES] as usize, 8),
            };
            if offset % falign != 0 {
                return Err(format!(
                    "{}:{fline}: {name}::{fname} would sit at offset {offset}, not a multiple of its {falign}-byte \
                     alignment: add an explicit padding field before it",
                    p.file
                ));
            }
            if fields.iter().any(|f| f.name == fname) {
                return Err(format!("{}:{fline}: {name}::{fname} twice", p.file));
            }
            fields.push(Field {
                comments,
                name: fname,
                kind,
                offset,
            });
            offset += size;
            align = align.max(falign);
        }
        p.punct(";")?;
        if offset % align != 0 || fields.is_empty() {
            return Err(format!(
                "{}:{line}: struct {name} ends at byte {offset}, not a multiple of its {align}-byte alignment: \
                 add an explicit padding field at its end",
                p.file
            ));
        }
        // A global struct is `::Name` in the C checks.
        let mut path: Vec<&str> = namespaces.iter().map(String::as_str).collect();
        path.push(&name);
        let path = if namespaces.is_empty() {
            format!("::{name}")
        } else {
            path.join("::")
        };
        Ok(Struct {
            comments,
            path,
            name,
            line,
            fields,
            size: offset,
            align,
        })
    }

    fn define(&mut self, file: &str, line: usize, name: &str, ty: Int, value: i128) -> Result<(), String> {
        let (lo, hi) = ty.range();
        if !(lo..=hi).contains(&value) {
            return Err(format!(
                "{file}:{line}: {name} = {value} does not fit {}",
                rust_c_type(ty)
            ));
        }
        let key = format!("{}::{name}", self.scope.join("::"));
        if self.values.insert(key, value).is_some() {
            return Err(format!("{file}:{line}: {name} is defined twice"));
        }
        Ok(())
    }

    /// `name` as C++ finds it from the open namespaces: innermost first.
    fn lookup(&self, name: &str) -> Option<i128> {
        (0..=self.scope.len())
            .rev()
            .find_map(|n| {
                self.values
                    .get(&format!("{}::{name}", self.scope[..n].join("::")))
            })
            .copied()
    }

    /// `|` over `<<` over `+ -` over `* /`, with parentheses, literals and known constants.
    fn expr(&self, p: &mut Parser) -> Result<i128, String> {
        let mut v = self.shift(p)?;
        while p.eat("|") {
            let r = self.shift(p)?;
            v = p.nonneg(v)? | p.nonneg(r)?;
        }
        Ok(v)
    }
    fn shift(&self, p: &mut Parser) -> Result<i128, String> {
        let mut v = self.sum(p)?;
        while p.eat("<<") {
            let r = self.sum(p)?;
            if !(0..64).contains(&r) {
                return Err(format!("{}:{}: shift by {r}", p.file, p.line()));
            }
            v = p.nonneg(v)? << r;
        }
        Ok(v)
    }
    fn sum(&self, p: &mut Parser) -> Result<i128, String> {
        let mut v = self.product(p)?;
        loop {
            if p.eat("+") {
                v += self.product(p)?;
            } else if p.eat("-") {
                v -= self.product(p)?;
            } else {
                return Ok(v);
            }
        }
    }
    fn product(&self, p: &mut Parser) -> Result<i128, String> {
        let mut v = self.atom(p)?;
        loop {
            if p.eat("*") {
                v *= self.atom(p)?;
            } else if p.eat("/") {
                let d = self.atom(p)?;
                if d <= 0 || v < 0 {
                    return Err(format!("{}:{}: division of {v} by {d}", p.file, p.line()));
                }
                v /= d;
            } else {
                return Ok(v);
            }
        }
    }
    fn atom(&self, p: &mut Parser) -> Result<i128, String> {
        let line = p.line();
        match p.next() {
            Some(Tok::Punct("(")) => {
                let v = self.expr(p)?;
                p.punct(")")?;
                Ok(v)
            }
            Some(Tok::Num(n)) => parse_number(&n).ok_or_else(|| {
                format!(
                    "{}:{line}: `{n}`: integer literals are decimal or 0x hex with an optional u suffix",
                    p.file
                )
            }),
            Some(Tok::Ident(n)) => self
                .lookup(&n)
                .ok_or_else(|| format!("{}:{line}: `{n}` is no constant defined above", p.file)),
            other => Err(format!(
                "{}:{line}: expected a number, a constant or `(`, found {}",
                p.file,
                other.as_ref().map_or("the end".to_string(), show)
            )),
        }
    }

    /// The Rust module: one `pub mod` per header, constants and `#[repr(C)]` structs with
    /// their layout asserted.
    pub fn rust(&self) -> String {
        let mut out = String::from(
            "// @generated by crates/gin-ep-build (abi_gen.rs) from the kernels' abi/*.h; do not edit.\n",
        );
        for m in self.modules.iter().filter(|m| m.emit) {
            let _ = writeln!(out, "\n/// {}/{}", m.root, m.file);
            let _ = writeln!(out, "pub mod {} {{", m.name);
            for item in &m.items {
                match item {
                    Item::Const {
                        comments,
                        name,
                        ty,
                        value,
                    } => {
                        push_comments(&mut out, comments, "    ");
                        let _ = writeln!(
                            out,
                            "    pub const {}: {} = {value};",
                            rust_const(name),
                            ty.rust()
                        );
                    }
                    Item::Struct(s) => {
                        push_comments(&mut out, &s.comments, "    ");
                        let plain = s
                            .fields
                            .iter()
                            .all(|f| matches!(f.kind, Kind::Int(_) | Kind::Addr));
                        let derive = if plain {
                            "Clone, Copy, Debug, Default, PartialEq, Eq"
                        } else {
                            "Clone, Copy, Debug"
                        };
                        let _ = writeln!(
                            out,
                            "    /// `{}` ({}/{}:{}).\n    #[repr(C)]\n    #[derive({derive})]\n    pub struct {} {{",
                            s.path, m.root, m.file, s.line, s.name
                        );
                        for f in &s.fields {
                            push_comments(&mut out, &f.comments, "        ");
                            let ty = match f.kind {
                                Kind::Int(i) => i.rust(),
                                Kind::Addr => "u64",
                                Kind::Window => "::gin_ep_sys::ncclWindow_t",
                                Kind::DevComm => "::gin_ep_sys::DevCommSlot",
                            };
                            let _ = writeln!(out, "        pub {}: {ty},", rust_field(&f.name));
                        }
                        let _ = writeln!(out, "    }}");
                        let _ = writeln!(
                            out,
                            "    const _: () = assert!(core::mem::size_of::<{0}>() == {1} && core::mem::align_of::<{0}>() == {2});",
                            s.name, s.size, s.align
                        );
                        for f in &s.fields {
                            let _ = writeln!(
                                out,
                                "    const _: () = assert!(core::mem::offset_of!({}, {}) == {});",
                                s.name,
                                rust_field(&f.name),
                                f.offset
                            );
                        }
                    }
                }
            }
            let _ = writeln!(out, "}}");
        }
        out
    }

    /// The C++ checks of every struct's size and field offsets, for the kernel build.
    pub fn c_checks(&self) -> String {
        let mut out = String::from(
            "// @generated by crates/gin-ep-build (abi_gen.rs) from the kernels' abi/*.h; do not edit.\n\
             // The layouts the Rust side was generated with: nvcc must lay the structs out alike.\n\
             #include <stddef.h>\n",
        );
        for m in self.modules.iter().filter(|m| m.emit) {
            for item in &m.items {
                let Item::Struct(s) = item else { continue };
                let _ = writeln!(
                    out,
                    "static_assert(sizeof({0}) == {1} && alignof({0}) == {2}, \"{3}/{4}:{5}: {6}: size or alignment \
                     differs from the generated Rust\");",
                    s.path, s.size, s.align, m.root, m.file, s.line, s.name
                );
                for f in &s.fields {
                    let _ = writeln!(
                        out,
                        "static_assert(offsetof({}, {}) == {}, \"{}/{}:{}: {}::{}: offset differs from the generated Rust\");",
                        s.path, f.name, f.offset, m.root, m.file, s.line, s.name, f.name
                    );
                }
            }
        }
        out
    }
}

struct Parser<'a> {
    file: &'a str,
    toks: &'a [(Tok, usize)],
    at: usize,
    comments: &'a [(usize, String)],
    next_comment: usize,
    last_line: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<(Tok, usize)> {
        self.toks.get(self.at).cloned()
    }
    fn line(&self) -> usize {
        self.toks.get(self.at).map_or(self.last_line, |t| t.1)
    }
    fn bump(&mut self) {
        self.at += 1;
    }
    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.at).map(|t| t.0.clone());
        self.at += 1;
        t
    }
    /// Own-line comments above `line` not yet taken.
    fn take_comments(&mut self, line: usize) -> Vec<String> {
        let mut out = Vec::new();
        while let Some((l, c)) = self.comments.get(self.next_comment) {
            if *l >= line {
                break;
            }
            out.push(c.clone());
            self.next_comment += 1;
        }
        out
    }
    fn eat(&mut self, p: &str) -> bool {
        if matches!(self.toks.get(self.at), Some((Tok::Punct(q), _)) if *q == p) {
            self.at += 1;
            return true;
        }
        false
    }
    fn eat_keyword(&mut self, k: &str) -> bool {
        if matches!(self.toks.get(self.at), Some((Tok::Ident(w), _)) if w == k) {
            self.at += 1;
            return true;
        }
        false
    }
    fn found(&self) -> String {
        self.toks
            .get(self.at)
            .map_or("the end of the file".to_string(), |t| show(&t.0))
    }
    fn punct(&mut self, p: &str) -> Result<(), String> {
        if self.eat(p) {
            return Ok(());
        }
        Err(format!(
            "{}:{}: expected `{p}`, found {}",
            self.file,
            self.line(),
            self.found()
        ))
    }
    fn keyword(&mut self, k: &str) -> Result<(), String> {
        if self.eat_keyword(k) {
            return Ok(());
        }
        Err(format!(
            "{}:{}: expected `{k}`, found {}",
            self.file,
            self.line(),
            self.found()
        ))
    }
    fn expect_text(&mut self, want: &str, what: &str) -> Result<(), String> {
        let ok = match self.toks.get(self.at) {
            Some((Tok::Ident(w), _)) => w == want,
            Some((Tok::Punct(p), _)) => *p == want,
            _ => false,
        };
        if ok {
            self.at += 1;
            return Ok(());
        }
        Err(format!(
            "{}:{}: expected {what}, found {}",
            self.file,
            self.line(),
            self.found()
        ))
    }
    fn ident(&mut self, what: &str) -> Result<String, String> {
        if let Some((Tok::Ident(w), _)) = self.toks.get(self.at) {
            self.at += 1;
            return Ok(w.clone());
        }
        Err(format!(
            "{}:{}: expected {what}, found {}",
            self.file,
            self.line(),
            self.found()
        ))
    }
    fn int_type(&mut self) -> Result<Int, String> {
        let line = self.line();
        let t = self.ident("an integer type")?;
        Int::parse(&t).ok_or_else(|| {
            format!(
                "{}:{line}: type `{t}`: only int, int32_t, uint32_t, int64_t, uint64_t or size_t",
                self.file
            )
        })
    }
    /// A constant's name: `k` then an upper-case letter.
    fn const_name(&mut self) -> Result<(String, usize), String> {
        let line = self.line();
        let n = self.ident("a constant name")?;
        let mut c = n.chars();
        if c.next() != Some('k') || !c.next().is_some_and(|c| c.is_ascii_uppercase()) {
            return Err(format!(
                "{}:{line}: constant `{n}`: names are kCamelCase",
                self.file
            ));
        }
        Ok((n, line))
    }
    fn nonneg(&self, v: i128) -> Result<i128, String> {
        if v < 0 {
            return Err(format!("{}:{}: bit operation on {v}", self.file, self.line()));
        }
        Ok(v)
    }
}

fn show(t: &Tok) -> String {
    match t {
        Tok::Ident(s) | Tok::Num(s) => format!("`{s}`"),
        Tok::Punct(p) => format!("`{p}`"),
    }
}

fn rust_c_type(t: Int) -> &'static str {
    match t {
        Int::I32 => "int32_t",
        Int::U32 => "uint32_t",
        Int::I64 => "int64_t",
        Int::U64 => "uint64_t",
        Int::Usize => "size_t",
    }
}

/// `123`, `0x7f`, `4u`: the value (suffix `u`/`U` only, as the type comes from the declaration).
fn parse_number(n: &str) -> Option<i128> {
    let digits = n.strip_suffix(['u', 'U']).unwrap_or(n);
    match digits.strip_prefix("0x").or_else(|| digits.strip_prefix("0X")) {
        Some(hex) => i128::from_str_radix(hex, 16).ok(),
        None if digits.len() > 1 && digits.starts_with('0') => None, // octal
        None => digits.parse().ok(),
    }
}

/// `kStDispStart` -> `K_ST_DISP_START`, `kFp8Ue8m0` -> `K_FP8_UE8M0`.
pub fn rust_const(c: &str) -> String {
    let mut out = String::new();
    let mut prev: Option<char> = None;
    for ch in c.chars() {
        if ch.is_ascii_uppercase() && prev.is_some_and(|p| p.is_ascii_lowercase() || p.is_ascii_digit()) {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
        prev = Some(ch);
    }
    out
}

/// `lsa_stride4G` -> `lsa_stride4g`, `pad2_` -> `pad2`.
fn rust_field(c: &str) -> String {
    c.trim_end_matches('_').to_ascii_lowercase()
}

fn push_comments(out: &mut String, comments: &[String], indent: &str) {
    for c in comments {
        let _ = writeln!(out, "{indent}//{}{c}", if c.is_empty() { "" } else { " " });
    }
}

#[cfg(test)]
#[path = "abi_gen_tests.rs"]
mod tests;
