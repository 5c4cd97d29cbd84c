//! Running many tests against one control plane: a test binary with `harness = false`
//! whose `main` is a [`Suite`]. The control plane starts once, every test gets a fresh
//! namespace and a client, and the control plane is torn down after the last test, whatever
//! happened (a `static` would never be dropped, and its processes would outlive the run).
//! Output and flags are libtest's (via libtest-mimic): filters, `--list`, `--test-threads`.

use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kube::Client;
use libtest_mimic::{Arguments, Failed, Trial};

use super::{ControlPlane, Options};

/// What a test gets.
pub struct TestEnv {
    pub cp: Arc<ControlPlane>,
    /// A namespace of its own, ready for pods.
    pub ns: String,
    /// An admin client made on the test's own runtime.
    pub client: Client,
}

type BoxedTest =
    Box<dyn Fn(TestEnv) -> Pin<Box<dyn Future<Output = Result<()>> + Send>> + Send + Sync>;

/// A set of tests sharing one control plane.
#[derive(Default)]
pub struct Suite {
    options: Options,
    tests: Vec<(String, BoxedTest)>,
    timeout: Option<Duration>,
}

impl Suite {
    pub fn new() -> Self {
        Self::default()
    }

    /// What the control plane installs (YAML files, Gateway API or not).
    pub fn options(mut self, options: Options) -> Self {
        self.options = options;
        self
    }

    /// A test's time limit (default 5 minutes): past it, the test fails.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Adds a test.
    pub fn test<F, Fut>(mut self, name: &str, test: F) -> Self
    where
        F: Fn(TestEnv) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<()>> + Send + 'static,
    {
        self.tests
            .push((name.to_string(), Box::new(move |env| Box::pin(test(env)))));
        self
    }

    /// Parses libtest's flags, starts the control plane (unless only listing or nothing is
    /// selected), runs the tests, tears down, and returns the exit code.
    pub fn run(self) -> ExitCode {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "warn,kube_client=off".into()),
            )
            .with_test_writer()
            .try_init();
        let args = Arguments::from_args();
        let names: Vec<String> = self.tests.iter().map(|(n, _)| n.clone()).collect();
        let selected = names.iter().any(|n| selected(&args, n));
        let timeout = self.timeout.unwrap_or(Duration::from_secs(300));

        let setup = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build();
        let setup = match setup {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("cannot build a Tokio runtime: {e}");
                return ExitCode::FAILURE;
            }
        };
        let cp: Result<Arc<ControlPlane>, String> = if args.list || !selected {
            Err("not started".into())
        } else {
            let started = Instant::now();
            match setup.block_on(ControlPlane::start_with(self.options.clone())) {
                Ok(cp) => {
                    eprintln!(
                        "control plane up in {:.1?}; kubeconfig: {} (kubectl --kubeconfig ...)",
                        started.elapsed(),
                        cp.kubeconfig().display()
                    );
                    Ok(Arc::new(cp))
                }
                Err(e) => Err(format!("the control plane did not start: {e:#}")),
            }
        };

        let tests: Vec<(String, Arc<BoxedTest>)> = self
            .tests
            .into_iter()
            .map(|(n, t)| (n, Arc::new(t)))
            .collect();
        let trials = tests
            .into_iter()
            .map(|(name, test)| {
                let cp = cp.clone();
                let prefix = name.replace('_', "-");
                Trial::test(name, move || {
                    // A missing binary or a control plane that failed is every test's failure.
                    let cp = cp.map_err(Failed::from)?;
                    run_one(cp, &prefix, timeout, test).map_err(|e| Failed::from(format!("{e:#}")))
                })
            })
            .collect();
        let conclusion = libtest_mimic::run(&args, trials);

        // Teardown: every other holder of the Arc was a test, and they are done.
        if let Ok(cp) = cp {
            match Arc::try_unwrap(cp) {
                Ok(cp) => cp.shutdown(),
                Err(cp) => drop(cp),
            }
        }
        drop(setup);
        conclusion.exit_code()
    }
}

fn selected(args: &Arguments, name: &str) -> bool {
    let matches = |f: &str| {
        if args.exact {
            name == f
        } else {
            name.contains(f)
        }
    };
    let included = args.filter.as_deref().is_none_or(matches);
    let skipped = args.skip.iter().any(|s| matches(s));
    included && !skipped && !args.ignored
}

fn run_one(
    cp: Arc<ControlPlane>,
    prefix: &str,
    timeout: Duration,
    test: Arc<BoxedTest>,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the test's runtime")?;
    rt.block_on(async move {
        let client = cp.client()?;
        let ns = cp.namespace(prefix).await?;
        let env = TestEnv { cp, ns, client };
        tokio::time::timeout(timeout, test(env))
            .await
            .with_context(|| format!("timed out after {timeout:?}"))?
    })
}
