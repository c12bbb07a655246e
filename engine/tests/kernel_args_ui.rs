//! Compile-fail tests for `#[derive(KernelArgs)]`: misuse gives a spanned error, not a bad launch.

#[test]
fn kernel_args_misuse_does_not_compile() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/kernel_args_*.rs");
}
