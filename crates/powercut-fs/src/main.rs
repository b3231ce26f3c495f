fn main() -> std::process::ExitCode {
    ashlar_powercut_fs::daemon::main(std::env::args().skip(1).collect())
}
