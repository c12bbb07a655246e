fn main() {
    eprintln!("memra: nothing here yet");
}
