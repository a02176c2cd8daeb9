//! The calls a router makes to a decode's HTTP port (docs/routing.md): the dataplane
//! serves them, the router (`tandem-router`) calls them. JSON field names are camelCase.

/// `GET` [`REPORT_PATH`]`?since=<version>`: the decode's load and the keys of the KV
/// blocks its prefix cache holds: `{"blockTokens", "waiting", "running", "kvBlocksUsed",
/// "kvBlocksTotal", "kvCacheUsage", "prefixVersion", "engineStalledMs", "keys"}`; `keys`
/// (16 hex digits each) is left out when the prefix cache has not changed since `since`;
/// `engineStalledMs` is how long the engine has had requests queued or running without a
/// successful step (0 while idle or stepping).
pub const REPORT_PATH: &str = "/tandem/report";

/// `POST` [`PROMPT_KEYS_PATH`]`?api=chat|completions` with the body of an OpenAI request:
/// the chained keys of the whole KV blocks of the prompt that request would run,
/// tokenized exactly as the decode would tokenize it: `{"blockTokens", "promptTokens",
/// "keys"}`. Nothing is generated.
pub const PROMPT_KEYS_PATH: &str = "/tandem/prompt-keys";
