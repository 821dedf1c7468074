//! The kinds of job the fleet serves, as one table: a row per path, saying
//! what a backend must offer for it and how its requests and answers are
//! read. A new kind of job is a row here, not a second code path. The data
//! plane routes by it; the agent reads an answer's usage by it.

use crate::v1::EndpointKind;

/// Where a request names its model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelIn {
    /// The `model` member of a JSON object.
    Json,
    /// The `model` field of a `multipart/form-data` body (an upload).
    Multipart,
}

/// The shape of the errors a client of the path expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ErrorShape {
    /// `{"error":{"message","type","param","code"}}`; in a stream, a
    /// `data:` event of it.
    #[default]
    OpenAi,
    /// `{"type":"error","error":{"type","message"}}`; in a stream, an
    /// `event: error` of it.
    Anthropic,
}

/// Where an answer says what it used, for the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UsageIn {
    /// At its end: OpenAI's `usage` (Responses' names too), or
    /// llama-server's `timings`.
    Tail,
    /// Anthropic's: the stream's first event (`message_start`) holds the
    /// prompt's tokens and cache reads, its `message_delta` near the end
    /// the output's; a whole answer has both at its end.
    HeadAndTail,
    /// Nowhere: the request is counted, its tokens are not (a token
    /// count, a transcription, an image).
    None,
}

/// Whether a path's requests get a session key, which keeps a
/// conversation's turns with its KV cache, and where it is found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Session {
    /// None: an embedding or a rerank leaves nothing worth coming back to,
    /// and a key for it would only push conversations out of its node's
    /// session table.
    None,
    /// One the client names (a header, `prompt_cache_key`), only.
    Named,
    /// One the client names, else its opening's: a chat's system prompt
    /// and first user message, a completion's first bytes, a Responses
    /// request's instructions and input.
    Opening,
    /// One the client names, else a Messages request's opening: the
    /// `system` beside its messages and its first user message.
    MessagesOpening,
}

/// How a stream of the kind ends when it ends well (or with the error
/// event its server sends itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamEnd {
    /// `data: [DONE]`.
    Done,
    /// An event of this type (Messages' `message_stop`).
    Event(&'static str),
    /// Its own last events, not checked (the Responses API ends with one of
    /// several).
    Own,
}

/// The event a stream of the kind opens with, which its clients read
/// before any other. A stream its server starts with another event gets
/// this one put ahead of it: llama-server writes it with the first token's
/// text, and leaves it out where that text is held back (the first bytes
/// of a character split across tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamStart {
    /// Any event: nothing is read of the stream's start.
    Any,
    /// Messages' `message_start`: the message's id, model and prompt usage.
    MessageStart,
    /// The Responses API's `response.created` (then `response.in_progress`).
    ResponseCreated,
}

impl StreamStart {
    /// The type of the event a stream of the kind opens with.
    pub fn event(self) -> Option<&'static str> {
        match self {
            StreamStart::Any => None,
            StreamStart::MessageStart => Some("message_start"),
            StreamStart::ResponseCreated => Some("response.created"),
        }
    }
}

/// One path the fleet serves.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    pub path: &'static str,
    /// What a backend must serve for the model.
    pub kind: EndpointKind,
    pub model: ModelIn,
    pub session: Session,
    pub errors: ErrorShape,
    pub usage: UsageIn,
    pub stream_start: StreamStart,
    pub stream_end: StreamEnd,
    /// A stream that would end without its usage is asked for it
    /// (`stream_options.include_usage`), the extra chunk kept from the
    /// client.
    pub asks_usage: bool,
    /// A stream sent to llama-server is asked for its prompt progress
    /// (`return_progress`), the events kept from the client: a stream cut
    /// short before its usage chunk is counted for the prompt the server
    /// read. Only where the server sends them in this path's answers.
    pub asks_progress: bool,
    /// A stream that breaks may go on at another node (fleet policy): only
    /// where the data plane can read and resend what was said so far.
    pub continues: bool,
    /// The stream's events are numbered and say which output item and
    /// content part they are about, as the Responses API's are: the data
    /// plane fills in what a server left out.
    pub numbers_events: bool,
}

const OPENAI: Row = Row {
    path: "",
    kind: EndpointKind::Chat,
    model: ModelIn::Json,
    session: Session::None,
    errors: ErrorShape::OpenAi,
    usage: UsageIn::Tail,
    stream_start: StreamStart::Any,
    stream_end: StreamEnd::Own,
    asks_usage: false,
    asks_progress: false,
    continues: false,
    numbers_events: false,
};

/// A row that holds no conversation: an embedding, a rerank, an upload.
const fn job(path: &'static str, kind: EndpointKind, model: ModelIn, usage: UsageIn) -> Row {
    Row { path, kind, model, usage, ..OPENAI }
}

/// Every path the fleet serves, and only these: any other is a 404.
pub const ROWS: &[Row] = &[
    Row {
        path: "/v1/chat/completions",
        session: Session::Opening,
        stream_end: StreamEnd::Done,
        asks_usage: true,
        asks_progress: true,
        continues: true,
        ..OPENAI
    },
    Row {
        path: "/v1/completions",
        kind: EndpointKind::Completion,
        session: Session::Opening,
        stream_end: StreamEnd::Done,
        asks_usage: true,
        asks_progress: true,
        ..OPENAI
    },
    Row {
        path: "/v1/responses",
        kind: EndpointKind::Responses,
        session: Session::Opening,
        stream_start: StreamStart::ResponseCreated,
        numbers_events: true,
        ..OPENAI
    },
    Row {
        path: "/v1/messages",
        kind: EndpointKind::Messages,
        session: Session::MessagesOpening,
        errors: ErrorShape::Anthropic,
        usage: UsageIn::HeadAndTail,
        stream_start: StreamStart::MessageStart,
        stream_end: StreamEnd::Event("message_stop"),
        ..OPENAI
    },
    Row {
        path: "/v1/messages/count_tokens",
        kind: EndpointKind::Messages,
        errors: ErrorShape::Anthropic,
        usage: UsageIn::None,
        ..OPENAI
    },
    // An editor's completions of one file share its cache where it names
    // a session; its prefix changes with every keystroke, so no root is
    // derived from it.
    Row { path: "/infill", kind: EndpointKind::Infill, session: Session::Named, ..OPENAI },
    job("/v1/embeddings", EndpointKind::Embedding, ModelIn::Json, UsageIn::Tail),
    job("/v1/rerank", EndpointKind::Rerank, ModelIn::Json, UsageIn::Tail),
    job("/v1/reranking", EndpointKind::Rerank, ModelIn::Json, UsageIn::Tail),
    job("/rerank", EndpointKind::Rerank, ModelIn::Json, UsageIn::Tail),
    job("/reranking", EndpointKind::Rerank, ModelIn::Json, UsageIn::Tail),
    job("/v1/audio/transcriptions", EndpointKind::Transcription, ModelIn::Multipart, UsageIn::None),
    job("/v1/audio/speech", EndpointKind::Speech, ModelIn::Json, UsageIn::None),
    job("/v1/images/generations", EndpointKind::Images, ModelIn::Json, UsageIn::None),
    job("/v1/images/edits", EndpointKind::Images, ModelIn::Multipart, UsageIn::None),
];

/// The row of `path`, if the fleet serves it.
pub fn row(path: &str) -> Option<&'static Row> {
    ROWS.iter().find(|row| row.path == path)
}

/// Whether a backend's 501 for a request of `kind` says the model cannot do
/// the kind at all (llama-server: no FIM tokens, not started with
/// `--embeddings` or `--reranking`), so no request of it should go there
/// again. For other kinds a 501 may be about one request's parameters, and
/// a client could use it to shut a model out for everyone.
pub fn refused_whole(kind: EndpointKind) -> bool {
    matches!(kind, EndpointKind::Infill | EndpointKind::Embedding | EndpointKind::Rerank)
}

/// Whether a request of `kind` is a batch (embeddings, reranks): each of
/// its inputs a prompt of its own, in a window of its own, so that its
/// body's length says nothing of whether it fits one.
pub fn is_batch(kind: EndpointKind) -> bool {
    matches!(kind, EndpointKind::Embedding | EndpointKind::Rerank)
}

/// A kind's name, as configuration, `inferyesctl` and error messages say
/// it.
pub fn name(kind: EndpointKind) -> &'static str {
    match kind {
        EndpointKind::Chat => "chat",
        EndpointKind::Completion => "completion",
        EndpointKind::Embedding => "embedding",
        EndpointKind::Rerank => "rerank",
        EndpointKind::Responses => "responses",
        EndpointKind::Messages => "messages",
        EndpointKind::Infill => "infill",
        EndpointKind::Transcription => "transcription",
        EndpointKind::Speech => "speech",
        EndpointKind::Images => "images",
        EndpointKind::Unspecified => "unspecified",
    }
}

/// The kind named `name` in configuration.
pub fn named(name: &str) -> Option<EndpointKind> {
    KINDS.iter().copied().find(|kind| self::name(*kind) == name)
}

/// Every kind a backend may serve.
pub const KINDS: [EndpointKind; 10] = [
    EndpointKind::Chat,
    EndpointKind::Completion,
    EndpointKind::Embedding,
    EndpointKind::Rerank,
    EndpointKind::Responses,
    EndpointKind::Messages,
    EndpointKind::Infill,
    EndpointKind::Transcription,
    EndpointKind::Speech,
    EndpointKind::Images,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_path_is_one_row_and_each_kind_has_a_path_and_a_name() {
        for (i, row) in ROWS.iter().enumerate() {
            assert!(row.path.starts_with('/'), "{row:?}");
            assert!(ROWS[i + 1..].iter().all(|other| other.path != row.path), "{} twice", row.path);
            assert!(
                row.continues <= (row.stream_end == StreamEnd::Done),
                "{}: continued streams end with [DONE]",
                row.path
            );
        }
        for kind in KINDS {
            assert!(ROWS.iter().any(|row| row.kind == kind), "{kind:?} has no path");
            assert_eq!(named(name(kind)), Some(kind));
        }
        assert_eq!(named("unspecified"), None);
        assert_eq!(row("/v1/messages").map(|r| r.errors), Some(ErrorShape::Anthropic));
        assert!(row("/v1/chat/completions/").is_none(), "paths are exact");
        // Every kind there is, is in KINDS.
        for value in 0..64 {
            if let Ok(kind) = EndpointKind::try_from(value) {
                assert!(kind == EndpointKind::Unspecified || KINDS.contains(&kind), "{kind:?} is not in KINDS");
            }
        }
    }
}
