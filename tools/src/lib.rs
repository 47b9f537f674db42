//! The tools around the gateway: the simulated vLLM replica (`sim`), the agent
//! load generator and its reports (`loadgen`), the real engines the tests and
//! benchmarks start (llama.cpp: `engine`; vLLM's CPU build: `vllm`), `agent-gateway demo` (`demo`), and
//! the little WebSocket the simulator's Responses WebSocket mode speaks (`ws`).
//! They drive the gateway as a user would, through its binary and its HTTP
//! interfaces; the gateway's library knows nothing of them.

pub mod demo;
pub mod engine;
pub mod loadgen;
pub mod sim;
pub mod vllm;
pub mod ws;
