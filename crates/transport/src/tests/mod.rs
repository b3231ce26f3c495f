//! Behavioural tests of connections. `suite` runs on both transports (`on_both!`); `sim_faults`
//! needs fault injection and runs on the simulated network only.

mod env;
mod rogue;
mod sim_faults;
mod suite;

/// Runs each named test of `suite` once over TCP and once over the simulated network.
macro_rules! on_both {
    ($($name:ident),* $(,)?) => {
        mod tcp {
            $(
                #[tokio::test]
                async fn $name() {
                    super::suite::$name(&super::env::TcpEnv).await;
                }
            )*
        }
        // Paused time: the simulated network needs no real time, so these cannot be upset by
        // a loaded machine.
        mod sim {
            $(
                #[tokio::test(start_paused = true)]
                async fn $name() {
                    super::suite::$name(&super::env::SimEnv::new(7)).await;
                }
            )*
        }
    };
}

on_both!(
    round_trip_many_concurrent_calls,
    responses_out_of_order_reach_their_callers,
    stranger_with_wrong_secret_is_refused,
    impostor_server_is_refused,
    forged_client_proof_is_refused,
    bad_frames_close_the_connection,
    oversize_payload_is_refused_before_sending,
    in_flight_limit_makes_the_next_call_wait,
    timed_out_call_leaves_connection_usable,
    peer_crash_fails_pending_calls_promptly,
    handler_errors_and_panics_reach_the_caller,
    quiet_connection_stays_open,
    dropping_the_connection_closes_it_on_the_server,
    large_payloads_round_trip,
);
