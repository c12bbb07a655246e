//! Compile-time behaviour of `arch!`: every spec expands to code that compiles, and each kind
//! of mistake is a spanned error that says what is wrong (tests/ui/fail/*.stderr).

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
