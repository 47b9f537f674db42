//! Just enough WebSocket (RFC 6455) for the simulator's Responses WebSocket
//! mode and the tests that drive it: the handshake's accept key, and whole
//! text, close, ping and pong frames, masked from a client and unmasked from
//! a server. No fragmentation, no extensions.

use base64::Engine as _;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest message either side accepts.
pub const MAX_MESSAGE: usize = 16 << 20;

const TEXT: u8 = 0x1;
const CLOSE: u8 = 0x8;
const PING: u8 = 0x9;
const PONG: u8 = 0xA;

/// `Sec-WebSocket-Accept` for a handshake's `Sec-WebSocket-Key`.
pub fn accept_key(key: &str) -> String {
    let mut sha = sha1_smol::Sha1::new();
    sha.update(key.trim().as_bytes());
    sha.update(b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11");
    base64::engine::general_purpose::STANDARD.encode(sha.digest().bytes())
}

/// One side of an open WebSocket.
pub struct Socket<S> {
    io: S,
    /// A client masks what it sends; a server does not.
    client: bool,
    mask_seed: u32,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Socket<S> {
    pub fn client(io: S) -> Self {
        Socket {
            io,
            client: true,
            mask_seed: 0x9e37_79b9,
        }
    }

    pub fn server(io: S) -> Self {
        Socket {
            io,
            client: false,
            mask_seed: 0,
        }
    }

    pub async fn send_text(&mut self, text: &str) -> std::io::Result<()> {
        self.send(TEXT, text.as_bytes()).await
    }

    pub async fn close(&mut self) -> std::io::Result<()> {
        self.send(CLOSE, &1000u16.to_be_bytes()).await
    }

    async fn send(&mut self, opcode: u8, payload: &[u8]) -> std::io::Result<()> {
        let mut frame = Vec::with_capacity(payload.len() + 14);
        frame.push(0x80 | opcode);
        let masked = if self.client { 0x80 } else { 0 };
        match payload.len() {
            n if n < 126 => frame.push(masked | n as u8),
            n if n <= u16::MAX as usize => {
                frame.push(masked | 126);
                frame.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                frame.push(masked | 127);
                frame.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        if self.client {
            self.mask_seed = self
                .mask_seed
                .wrapping_mul(0x0101_0101)
                .wrapping_add(0x6d2b_79f5);
            let mask = self.mask_seed.to_be_bytes();
            frame.extend_from_slice(&mask);
            frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        } else {
            frame.extend_from_slice(payload);
        }
        self.io.write_all(&frame).await?;
        self.io.flush().await
    }

    /// The next text message; `None` once the peer closed (a close frame,
    /// or the connection ended). Pings are answered on the way.
    pub async fn recv_text(&mut self) -> std::io::Result<Option<String>> {
        loop {
            let mut head = [0u8; 2];
            if self.io.read_exact(&mut head).await.is_err() {
                return Ok(None);
            }
            let opcode = head[0] & 0x0f;
            let len = match head[1] & 0x7f {
                126 => self.io.read_u16().await? as usize,
                127 => self.io.read_u64().await? as usize,
                n => n as usize,
            };
            if len > MAX_MESSAGE || head[0] & 0x80 == 0 {
                return Err(std::io::Error::other("oversized or fragmented frame"));
            }
            let mut mask = [0u8; 4];
            if head[1] & 0x80 != 0 {
                self.io.read_exact(&mut mask).await?;
            }
            let mut payload = vec![0u8; len];
            self.io.read_exact(&mut payload).await?;
            for (i, b) in payload.iter_mut().enumerate() {
                *b ^= mask[i % 4];
            }
            match opcode {
                TEXT => {
                    return String::from_utf8(payload)
                        .map(Some)
                        .map_err(std::io::Error::other)
                }
                CLOSE => {
                    let _ = self.send(CLOSE, &payload).await;
                    return Ok(None);
                }
                PING => self.send(PONG, &payload).await?,
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rfcs_example_key() {
        assert_eq!(
            accept_key("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[tokio::test]
    async fn messages_cross_both_ways_at_every_length_form() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let mut client = Socket::client(a);
        let mut server = Socket::server(b);
        for n in [0, 125, 126, 65_535, 65_536] {
            let text = "x".repeat(n);
            client.send_text(&text).await.unwrap();
            assert_eq!(server.recv_text().await.unwrap().as_deref(), Some(&*text));
            server.send_text(&text).await.unwrap();
            assert_eq!(client.recv_text().await.unwrap().as_deref(), Some(&*text));
        }
        client.close().await.unwrap();
        assert_eq!(server.recv_text().await.unwrap(), None);
    }
}
