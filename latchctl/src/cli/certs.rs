//! `latchctl dev-certs`: a throwaway trust domain for the local stack.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::dev_certs;
use clap::Args;
use serde_json::json;

use super::{Failure, Output};

use crate::dev_certs::DEV_NAMES as DEFAULT_NAMES;

#[derive(Debug, Args)]
pub struct DevCertsArgs {
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    #[arg(long, value_name = "TD")]
    pub trust_domain: String,
    /// Workload names to issue SVIDs for (default: the dev stack's set).
    #[arg(long = "name", value_name = "NAME")]
    pub names: Vec<String>,
}

pub fn run(args: DevCertsArgs, out: Output) -> Result<ExitCode, Failure> {
    let names: Vec<&str> = if args.names.is_empty() {
        DEFAULT_NAMES.to_vec()
    } else {
        args.names.iter().map(String::as_str).collect()
    };
    let domain = dev_certs::generate(&args.out, &args.trust_domain, &names)
        .map_err(|e| Failure::Other(anyhow::Error::from(e)))?;
    let svids: Vec<_> = names.iter().map(|name| domain.svid(name)).collect();
    if out.json {
        out.line(json!({
            "trust_domain": domain.trust_domain,
            "ca": domain.ca(),
            "svids": svids.iter().map(|s| json!({
                "spiffe_id": s.spiffe_id,
                "cert": s.cert,
                "key": s.key,
            })).collect::<Vec<_>>(),
        }));
    } else {
        println!("ca  {}", domain.ca().display());
        for svid in &svids {
            println!("{}", svid.spiffe_id);
            println!("    cert {}", svid.cert.display());
            println!("    key  {}", svid.key.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}
