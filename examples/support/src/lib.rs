//! What tower-lock's examples, in-process tests and bench share: a minimal
//! HTTP/1.1 client over one kept-alive connection (one connection per
//! client, so concurrent requests really are concurrent at the server),
//! and the examples' [`bank`].

pub mod bank;

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

pub struct Client {
    addr: SocketAddr,
    sender: SendRequest<Empty<Bytes>>,
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Client {
    pub async fn connect(addr: SocketAddr) -> std::io::Result<Client> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(conn);
        Ok(Client { addr, sender })
    }

    /// Sends `method path` with the given headers and reads the whole reply.
    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &[u8])],
    ) -> Result<Reply, hyper::Error> {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", self.addr.to_string());
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Empty::new()).expect("valid request");
        self.sender.ready().await?;
        let res = self.sender.send_request(req).await?;
        let (parts, body) = res.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }

    pub async fn post(&mut self, path: &str) -> Result<Reply, hyper::Error> {
        self.send("POST", path, &[]).await
    }
}
