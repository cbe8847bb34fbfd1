//! The kube client config from [`ApiAccess`]: in-cluster credentials or an explicit URL.

use std::path::Path;

use crate::{AgentTiming, ApiAccess, KubeError};

/// The kube `Config` for `api`. Files are checked here so that a missing token or CA is a
/// clear error at start, not a stream of failed requests.
pub fn kube_config(api: &ApiAccess, timing: &AgentTiming) -> Result<kube::Config, KubeError> {
    let mut cfg = match api {
        ApiAccess::InCluster => {
            kube::Config::incluster().map_err(|e| KubeError::InCluster(e.to_string()))?
        }
        ApiAccess::Url {
            url,
            token_file,
            ca_file,
            insecure_http,
        } => {
            let uri: http::Uri = url
                .parse()
                .map_err(|e| KubeError::Config(format!("API server URL {url:?}: {e}")))?;
            if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
                return Err(KubeError::Config(format!(
                    "API server URL {url:?}: expected http(s)://host[:port]"
                )));
            }
            if uri.scheme_str() == Some("http") && token_file.is_some() && !insecure_http {
                return Err(KubeError::Config(format!(
                    "API server URL {url:?}: a bearer token over plain http can be read by anyone on the path; use https:// (or set insecure_http for a local test server)"
                )));
            }
            let mut cfg = kube::Config::new(uri);
            if let Some(t) = token_file {
                readable(t, "token file")?;
                cfg.auth_info.token_file = Some(t.display().to_string());
            }
            if let Some(ca) = ca_file {
                let pem = readable(ca, "CA file")?;
                if !pem.contains("-----BEGIN CERTIFICATE-----") {
                    return Err(KubeError::Config(format!(
                        "CA file {}: no PEM certificate in it",
                        ca.display()
                    )));
                }
                cfg.root_cert_file = Some(ca.clone());
            }
            cfg
        }
    };
    // The agent backs off itself (visible in the view as api_reachable = false) rather than
    // have the client retry 429/503/504 silently behind it.
    cfg.default_retry = false;
    cfg.connect_timeout = Some(timing.connect_timeout);
    // A list that hangs must end too; a watch is ended by the server at watch_timeout_s.
    cfg.read_timeout = Some(std::time::Duration::from_secs(
        u64::from(timing.watch_timeout_s) + 30,
    ));
    cfg.reset_reader_on_write = true;
    Ok(cfg)
}

fn readable(path: &Path, what: &str) -> Result<String, KubeError> {
    std::fs::read_to_string(path)
        .map_err(|e| KubeError::Config(format!("{what} {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(u: &str) -> ApiAccess {
        ApiAccess::Url {
            url: u.into(),
            token_file: None,
            ca_file: None,
            insecure_http: false,
        }
    }

    #[test]
    fn an_explicit_url_is_taken_and_client_retries_are_off() {
        let c = kube_config(&url("https://10.0.0.1:6443"), &AgentTiming::default()).unwrap();
        assert_eq!(c.cluster_url.to_string(), "https://10.0.0.1:6443/");
        assert!(!c.default_retry);
        assert_eq!(
            c.connect_timeout,
            Some(AgentTiming::default().connect_timeout)
        );
    }

    #[test]
    fn bad_urls_are_config_errors_naming_the_url() {
        for bad in ["not a url", "ftp://x", "/just/a/path"] {
            let e = kube_config(&url(bad), &AgentTiming::default()).unwrap_err();
            assert!(
                matches!(e, KubeError::Config(_)) && e.to_string().contains(bad),
                "{e}"
            );
        }
    }

    #[test]
    fn missing_or_bad_credential_files_are_errors_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("token");
        let api = ApiAccess::Url {
            url: "https://h:1".into(),
            token_file: Some(missing.clone()),
            ca_file: None,
            insecure_http: false,
        };
        let e = kube_config(&api, &AgentTiming::default()).unwrap_err();
        assert!(e.to_string().contains("token file"), "{e}");
        let ca = dir.path().join("ca.crt");
        std::fs::write(&ca, "not pem").unwrap();
        let api = ApiAccess::Url {
            url: "https://h:1".into(),
            token_file: None,
            ca_file: Some(ca),
            insecure_http: false,
        };
        let e = kube_config(&api, &AgentTiming::default()).unwrap_err();
        assert!(e.to_string().contains("no PEM certificate"), "{e}");
    }

    #[test]
    fn the_token_file_becomes_the_bearer_source() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("token");
        std::fs::write(&t, "abc").unwrap();
        let api = ApiAccess::Url {
            url: "https://127.0.0.1:1".into(),
            token_file: Some(t.clone()),
            ca_file: None,
            insecure_http: false,
        };
        let c = kube_config(&api, &AgentTiming::default()).unwrap();
        assert_eq!(c.auth_info.token_file.as_deref(), Some(t.to_str().unwrap()));
    }

    #[test]
    fn a_bearer_token_over_plain_http_is_refused_unless_insecure_http_names_the_risk() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("token");
        std::fs::write(&t, "abc").unwrap();
        let api = |insecure_http| ApiAccess::Url {
            url: "http://10.0.0.1:8080".into(),
            token_file: Some(t.clone()),
            ca_file: None,
            insecure_http,
        };
        let e = kube_config(&api(false), &AgentTiming::default()).unwrap_err();
        assert!(
            matches!(e, KubeError::Config(_)) && e.to_string().contains("https"),
            "{e}"
        );
        let c = kube_config(&api(true), &AgentTiming::default()).unwrap();
        assert_eq!(c.auth_info.token_file.as_deref(), Some(t.to_str().unwrap()));
        // Without a token there is nothing to leak.
        kube_config(&url("http://10.0.0.1:8080"), &AgentTiming::default()).unwrap();
    }
}
