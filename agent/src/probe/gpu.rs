use std::sync::Arc;
use std::time::Duration;

use inferyes_proto::v1::{Gpu, GpuSource};
use nvml_wrapper::Nvml;
use serde_json::Value;

use super::client::ProbeClient;
use crate::config::{DeclaredGpu, GpuConfig, GpuSourceConfig};

/// Where this host's GPU readings come from, decided once at start.
#[derive(Clone)]
pub enum GpuReader {
    Nvml(Arc<Nvml>),
    NvidiaSmi,
    Declared(Vec<DeclaredGpu>),
    /// Base URLs of simulated backends; each exposes one GPU at /sim/gpu.
    Simulated(Vec<String>),
    None,
}

/// One reading, and the failure that stopped it, if any.
pub struct GpuReading {
    pub gpus: Vec<Gpu>,
    pub error: Option<String>,
}

const SMI_TIMEOUT: Duration = Duration::from_secs(5);

impl GpuReader {
    /// Picks the source. `auto` tries NVML (the library is loaded at run
    /// time, so a host without a driver simply has none), then nvidia-smi,
    /// then declared GPUs, then simulated ones.
    pub async fn detect(config: &GpuConfig, simulated: Vec<String>) -> anyhow::Result<GpuReader> {
        match config.source {
            GpuSourceConfig::Nvml => Ok(GpuReader::Nvml(Arc::new(init_nvml()?))),
            GpuSourceConfig::NvidiaSmi => {
                read_nvidia_smi().await?;
                Ok(GpuReader::NvidiaSmi)
            }
            GpuSourceConfig::Declared => Ok(GpuReader::Declared(config.declared.clone())),
            GpuSourceConfig::Simulated => Ok(GpuReader::Simulated(simulated)),
            GpuSourceConfig::None => Ok(GpuReader::None),
            GpuSourceConfig::Auto => {
                match init_nvml() {
                    Ok(nvml) => return Ok(GpuReader::Nvml(Arc::new(nvml))),
                    Err(error) => tracing::debug!(%error, "NVML not available"),
                }
                match read_nvidia_smi().await {
                    Ok(_) => return Ok(GpuReader::NvidiaSmi),
                    Err(error) => tracing::debug!(%error, "nvidia-smi not available"),
                }
                if !config.declared.is_empty() {
                    return Ok(GpuReader::Declared(config.declared.clone()));
                }
                if !simulated.is_empty() {
                    return Ok(GpuReader::Simulated(simulated));
                }
                tracing::info!("no GPU found or declared: reporting a CPU node");
                Ok(GpuReader::None)
            }
        }
    }

    pub fn source_name(&self) -> &'static str {
        match self {
            GpuReader::Nvml(_) => "nvml",
            GpuReader::NvidiaSmi => "nvidia-smi",
            GpuReader::Declared(_) => "declared",
            GpuReader::Simulated(_) => "simulated",
            GpuReader::None => "none",
        }
    }

    /// Reads every GPU. `loaded_model_bytes` is what the node's backends
    /// report as loaded: for declared GPUs, the only estimate of use there is.
    pub async fn read(&self, client: &ProbeClient, loaded_model_bytes: u64) -> GpuReading {
        match self {
            GpuReader::Nvml(nvml) => {
                let nvml = Arc::clone(nvml);
                match tokio::task::spawn_blocking(move || read_nvml(&nvml)).await {
                    Ok(Ok(gpus)) => GpuReading { gpus, error: None },
                    Ok(Err(error)) => GpuReading { gpus: Vec::new(), error: Some(error) },
                    Err(error) => GpuReading { gpus: Vec::new(), error: Some(error.to_string()) },
                }
            }
            GpuReader::NvidiaSmi => match read_nvidia_smi().await {
                Ok(gpus) => GpuReading { gpus, error: None },
                Err(error) => GpuReading { gpus: Vec::new(), error: Some(error.to_string()) },
            },
            GpuReader::Declared(declared) => {
                GpuReading { gpus: declared_gpus(declared, loaded_model_bytes), error: None }
            }
            GpuReader::Simulated(urls) => {
                let mut gpus = Vec::with_capacity(urls.len());
                let mut error = None;
                for (index, url) in urls.iter().enumerate() {
                    match client.get(url, "/sim/gpu", "").await {
                        Ok((status, body)) if status.is_success() => {
                            if let Some(gpu) = parse_sim_gpu(&body, index) {
                                gpus.push(gpu);
                            }
                        }
                        Ok((status, _)) => error = Some(format!("{url}/sim/gpu: HTTP {}", status.as_u16())),
                        Err(e) => error = Some(format!("{url}/sim/gpu: {e}")),
                    }
                }
                GpuReading { gpus, error }
            }
            GpuReader::None => GpuReading { gpus: Vec::new(), error: None },
        }
    }
}

fn init_nvml() -> anyhow::Result<Nvml> {
    Ok(Nvml::init()?)
}

fn read_nvml(nvml: &Nvml) -> Result<Vec<Gpu>, String> {
    let count = nvml.device_count().map_err(|e| e.to_string())?;
    let mut gpus = Vec::new();
    for index in 0..count {
        let device = nvml.device_by_index(index).map_err(|e| e.to_string())?;
        let memory = device.memory_info().map_err(|e| e.to_string())?;
        gpus.push(Gpu {
            index,
            uuid: device.uuid().unwrap_or_default(),
            name: device.name().unwrap_or_default(),
            memory_total_bytes: memory.total,
            memory_used_bytes: memory.used,
            utilization_percent: device.utilization_rates().map(|u| u.gpu).unwrap_or(0),
            source: GpuSource::Nvml as i32,
            stale: false,
        });
    }
    Ok(gpus)
}

async fn read_nvidia_smi() -> anyhow::Result<Vec<Gpu>> {
    let output = tokio::time::timeout(
        SMI_TIMEOUT,
        tokio::process::Command::new("nvidia-smi")
            .args([
                "--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu",
                "--format=csv,noheader,nounits",
            ])
            .kill_on_drop(true)
            .output(),
    )
    .await??;
    if !output.status.success() {
        anyhow::bail!("nvidia-smi exited with {}", output.status);
    }
    let gpus = parse_nvidia_smi(&String::from_utf8_lossy(&output.stdout));
    if gpus.is_empty() {
        anyhow::bail!("nvidia-smi listed no GPU");
    }
    Ok(gpus)
}

/// `nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu
/// --format=csv,noheader,nounits`: memory in MiB; fields may read `[N/A]`.
pub fn parse_nvidia_smi(text: &str) -> Vec<Gpu> {
    const MIB: u64 = 1 << 20;
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let [index, uuid, name, total, used, util] = fields.as_slice() else { return None };
            let number = |s: &str| s.parse::<u64>().ok();
            Some(Gpu {
                index: index.parse().ok()?,
                uuid: (*uuid).to_string(),
                name: (*name).to_string(),
                memory_total_bytes: number(total)? * MIB,
                memory_used_bytes: number(used).unwrap_or(0) * MIB,
                utilization_percent: util.parse().unwrap_or(0),
                source: GpuSource::NvidiaSmi as i32,
                stale: false,
            })
        })
        .collect()
}

/// Declared GPUs, with the loaded models' bytes spread over them in order.
fn declared_gpus(declared: &[DeclaredGpu], mut loaded_model_bytes: u64) -> Vec<Gpu> {
    declared
        .iter()
        .enumerate()
        .map(|(index, d)| {
            let used = loaded_model_bytes.min(d.memory_total_bytes);
            loaded_model_bytes -= used;
            Gpu {
                index: u32::try_from(index).unwrap_or(u32::MAX),
                uuid: String::new(),
                name: d.name.clone(),
                memory_total_bytes: d.memory_total_bytes,
                memory_used_bytes: used,
                utilization_percent: 0,
                source: GpuSource::Declared as i32,
                stale: false,
            }
        })
        .collect()
}

fn parse_sim_gpu(body: &[u8], index: usize) -> Option<Gpu> {
    let value: Value = serde_json::from_slice(body).ok()?;
    Some(Gpu {
        index: u32::try_from(index).unwrap_or(u32::MAX),
        uuid: format!("SIM-{index}"),
        name: value.get("name")?.as_str()?.to_string(),
        memory_total_bytes: value.get("memory_total_bytes")?.as_u64()?,
        memory_used_bytes: value.get("memory_used_bytes").and_then(Value::as_u64).unwrap_or(0),
        utilization_percent: value
            .get("utilization_percent")
            .and_then(Value::as_u64)
            .map(|u| u32::try_from(u.min(100)).unwrap_or(100))
            .unwrap_or(0),
        source: GpuSource::Simulated as i32,
        stale: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvidia_smi_csv_is_parsed_and_bad_lines_skipped() {
        let text = "0, GPU-aaa, NVIDIA H200, 143771, 1024, 37\n1, GPU-bbb, NVIDIA L4, 23034, [N/A], [N/A]\ngarbage\n";
        let gpus = parse_nvidia_smi(text);
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].name, "NVIDIA H200");
        assert_eq!(gpus[0].memory_total_bytes, 143771 << 20);
        assert_eq!(gpus[0].memory_used_bytes, 1024 << 20);
        assert_eq!(gpus[0].utilization_percent, 37);
        assert_eq!(gpus[1].memory_used_bytes, 0);
    }

    #[test]
    fn declared_gpus_carry_the_loaded_models() {
        let declared = vec![
            DeclaredGpu { name: "A".into(), memory_total_bytes: 10 },
            DeclaredGpu { name: "B".into(), memory_total_bytes: 10 },
        ];
        let gpus = declared_gpus(&declared, 14);
        assert_eq!(gpus.iter().map(|g| g.memory_used_bytes).collect::<Vec<_>>(), [10, 4]);
    }
}
