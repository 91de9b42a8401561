//! Tests of the ABI generator (abi_gen.rs): the accepted subset, errors that name the line,
//! namespace scoping and Rust names.
use super::*;

const COMMON: &str = "#pragma once\n#include <stddef.h>\nnamespace gin_ep {\nstatic const size_t kDevCommSlotBytes = 384;\n}  // namespace gin_ep\n";

fn read(src: &str) -> Result<Abi, String> {
    let mut abi = Abi::new();
    abi.read("abi/common.h", COMMON)?;
    abi.read("abi/t.h", src)?;
    Ok(abi)
}

fn err(src: &str) -> String {
    match read(src) {
        Ok(_) => panic!("accepted:\n{src}"),
        Err(e) => e,
    }
}

#[test]
fn constants_enums_and_structs_become_rust_with_their_layout() {
    let abi = read(
        "#pragma once\n#include \"abi/common.h\"\nnamespace gin_ep {\nnamespace t {\n\
         // Threads.\nstatic const int kThreads = 512;\nstatic const int kWarps = kThreads / 32, kTwo = (1 + 1) * 1;\n\
         static const uint32_t kFlagTop = 1u << 31 | 0x1;\nenum Dtype : int32_t { kBf16 = 0, kFp8Ue8m0 = 2 };\n\
         struct R {\n  unsigned long long n;\n};\nstruct Args {\n  union {\n    ncclDevComm comm;\n    DevCommSlot comm_slot;\n  };\n  ncclWindow_t win;\n\
         const uint16_t* x;  // [N][H]\n  uint32_t lsa_stride4G;\n  int32_t n;\n  uint64_t* stamps;\n};\n\
         }  // namespace t\n}  // namespace gin_ep\n",
    )
    .unwrap();
    let rust = abi.rust();
    for want in [
        "pub mod t {",
        "    // Threads.\n    pub const K_THREADS: i32 = 512;",
        "pub const K_WARPS: i32 = 16;",
        "pub const K_TWO: i32 = 2;",
        "pub const K_FLAG_TOP: u32 = 2147483649;",
        "pub const K_FP8_UE8M0: i32 = 2;",
        "pub comm: ::gin_ep_sys::DevCommSlot,",
        "pub lsa_stride4g: u32,",
        "size_of::<Args>() == 416 &&",
        "offset_of!(Args, x) == 392)",
        "offset_of!(Args, stamps) == 408)",
        "pub n: u64,",
    ] {
        assert!(rust.contains(want), "{want:?} not in\n{rust}");
    }
    let c = abi.c_checks();
    assert!(c.contains("sizeof(gin_ep::t::Args) == 416"), "{c}");
    assert!(
        c.contains("offsetof(gin_ep::t::Args, lsa_stride4G) == 400"),
        "{c}"
    );
}

#[test]
fn anything_outside_the_subset_fails_naming_the_line() {
    let head = "namespace gin_ep {\n";
    for (src, want) in [
        ("constexpr int kA = 1;\n", "t.h:2: expected `namespace`"),
        ("static const int kA = 1 % 2;\n", "t.h:2: unexpected `%`"),
        ("static const int kA = kB;\n", "t.h:2: `kB` is no constant"),
        ("static const float kA = 1;\n", "t.h:2: type `float`"),
        ("static const int A = 1;\n", "t.h:2: constant `A`"),
        (
            "static const uint32_t kA = 1u << 32;\n",
            "t.h:2: kA = 4294967296 does not fit",
        ),
        (
            "static const int kA = 1;\nstatic const int kA = 2;\n",
            "t.h:3: kA is defined twice",
        ),
        ("static const int kA = 010;\n", "t.h:2: `010`"),
        ("#define X 1\n", "t.h:2: `#define X 1`"),
        ("#include \"abi/ll.h\"\n", "t.h:2:"),
        (
            "struct S {\n  uint32_t a;\n  uint64_t b;\n};\n",
            "t.h:4: S::b would sit at offset 4",
        ),
        (
            "struct S {\n  uint64_t a;\n  uint32_t b;\n};\n",
            "t.h:2: struct S ends at byte 12",
        ),
        ("struct S {\n  float a;\n};\n", "t.h:3: field type `float`"),
        (
            "struct S {\n  uint64_t a;\n  union {\n",
            "t.h:4: the devcomm union must be the first",
        ),
        ("struct S {\n  int a[4];\n};\n", "t.h:3: unexpected `[`"),
        ("enum E : int { kA };\n", "t.h:2: expected `=`"),
        ("static const int kA = 1; /* x */\n", "t.h:2: only `//` comments"),
    ] {
        let src = format!("{head}{src}}}\n");
        let e = err(&src);
        assert!(e.contains(want), "{want:?} not in {e:?}");
    }
    assert!(err("namespace gin_ep {\n").contains("not closed"));
    assert!(err("static const int kA = 1;\n").contains("t.h:1: `static` outside a namespace"));
    // A global struct may name the slot and pointees by their qualified names.
    let abi = read(
        "struct G {\n  union {\n    ncclDevComm comm;\n    gin_ep::DevCommSlot comm_slot;\n  };\n\
         gin_ep::FabricError* err;\n};\n",
    )
    .unwrap();
    assert!(
        abi.c_checks().contains("offsetof(::G, err) == 384"),
        "{}",
        abi.c_checks()
    );
    assert!(err("struct S {\n  uint64_t a::b;\n};\n").contains("t.h:2: field name `a::b`"));
    let mut abi = Abi::new();
    assert!(abi
        .read("ll.h", "")
        .unwrap_err()
        .contains("abi/<lowercase name>.h"));
    assert!(abi
        .read("abi/t.h", "namespace x {\nstruct S {\n  union {\n")
        .unwrap_err()
        .contains("kDevCommSlotBytes"));
}

#[test]
fn names_are_scoped_by_namespace_as_in_cpp() {
    let mut abi =
        read("namespace gin_ep {\nnamespace a {\nstatic const int kMax = 1;\n}  // namespace a\n}\n")
            .unwrap();
    abi.read(
        "abi/u.h",
        "namespace gin_ep {\nnamespace b {\nstatic const int kMax = 2;\nstatic const int kTwice = kMax * 2;\n\
         static const size_t kSlot = kDevCommSlotBytes;\n}  // namespace b\n}  // namespace gin_ep\n",
    )
    .unwrap();
    let rust = abi.rust();
    assert!(rust.contains("pub const K_TWICE: i32 = 4;"), "{rust}");
    assert!(rust.contains("pub const K_SLOT: usize = 384;"), "{rust}");
    let e = abi
        .read(
            "abi/v.h",
            "namespace gin_ep {\nnamespace a {\nstatic const int kMax = 3;\n}\n}\n",
        )
        .unwrap_err();
    assert!(e.contains("v.h:3: kMax is defined twice"), "{e}");
    let e = abi
        .read("abi/w.h", "namespace gin_ep {\nnamespace c {\nstatic const int kMax = 3;\n}\nnamespace d {\nstatic const int kMax = 4;\n}\n}\n")
        .unwrap_err();
    assert!(e.contains("kMax and kMax are both K_MAX"), "{e}");
}

#[test]
fn constant_names_spell_in_rust_screaming_case() {
    assert_eq!(rust_const("kStDispStart"), "K_ST_DISP_START");
    assert_eq!(rust_const("kFp8Ue8m0"), "K_FP8_UE8M0");
    assert_eq!(rust_const("kMaxGrid"), "K_MAX_GRID");
    assert_eq!(rust_field("lsa_stride4G"), "lsa_stride4g");
    assert_eq!(rust_field("pad2_"), "pad2");
}

#[test]
fn a_dependency_header_lends_its_definitions_but_is_not_written_out() {
    let mut abi = Abi::new();
    abi.read_in("kernels", "abi/common.h", COMMON, false).unwrap();
    abi.read_in(
        "crates/lab/kernels",
        "abi/lab.h",
        "#pragma once\n#include <stdint.h>\n#include \"abi/common.h\"\nnamespace gin_ep {\n\
         static const size_t kTwoSlots = 2 * kDevCommSlotBytes;\nstruct LabArgs {\n  uint64_t words;\n};\n}\n",
        true,
    )
    .unwrap();
    let rust = abi.rust();
    assert!(rust.contains("pub const K_TWO_SLOTS: usize = 768;"), "{rust}");
    assert!(
        rust.contains("/// crates/lab/kernels/abi/lab.h\npub mod lab {"),
        "{rust}"
    );
    assert!(rust.contains("(crates/lab/kernels/abi/lab.h:"), "{rust}");
    assert!(!rust.contains("pub mod common"), "{rust}");
    let checks = abi.c_checks();
    assert!(checks.contains("\"crates/lab/kernels/abi/lab.h:"), "{checks}");
    assert!(checks.contains("sizeof(gin_ep::LabArgs) == 8"), "{checks}");
}
