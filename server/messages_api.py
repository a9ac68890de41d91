"""The Anthropic Messages routes: `POST /v1/messages` and `POST /v1/messages/count_tokens`, with
errors in Anthropic's shape. The request becomes a chat job (`ballast.server.messages`); its
answer is written by `ballast.server.messages_out`."""

from __future__ import annotations

from ballast.server import chat
from ballast.server.auth import bearer_dependency
from ballast.server.completions import check_model, ready_engine
from ballast.server.errors import AnthropicRoute
from ballast.server.messages import CountTokensRequest, MessagesRequest, to_chat
from ballast.server.messages_out import MessageEvents, message, message_id
from ballast.server.respond import collect_all
from ballast.server.state import ServerState
from ballast.server.translate import ending, start_chat, stream_blocks, whole_answer
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def messages_router(api_key: str | None) -> APIRouter:
    router = APIRouter(
        prefix="/v1", dependencies=[Depends(bearer_dependency(api_key))], route_class=AnthropicRoute
    )

    @router.post("/messages", response_model=None)
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        state: ServerState = request.app.state.ballast
        begun = await start_chat(state, lambda: to_chat(body), request)
        if begun is None:
            return Response(status_code=499)
        job, started = begun
        msg_id = message_id()
        if job.stream:
            events = MessageEvents(msg_id, job.model, job.prompt_tokens)
            return StreamingResponse(
                stream_blocks(state, job, started, events),
                media_type="text/event-stream",
                headers=STREAM_HEADERS,
            )
        [result] = await collect_all(state, job, started, request)
        answer = whole_answer(job, result)
        assert state.engine is not None
        end = ending(
            job, state.engine.tokenizer, result.finish, result.token_ids, result.text, bool(answer.calls)
        )
        return JSONResponse(message(msg_id, job.model, answer, end))

    @router.post("/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
        state: ServerState = request.app.state.ballast
        check_model(state, body.model)
        tokenizer, _ = ready_engine(state)
        return JSONResponse({"input_tokens": len(chat.chat_prompt(state, tokenizer, to_chat(body)))})

    return router
