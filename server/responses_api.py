"""The OpenAI Responses route, `POST /v1/responses` (stateless). The request becomes a chat job
(`ballast.server.responses`); its answer is written by `ballast.server.responses_out`."""

from __future__ import annotations

from ballast.server.auth import bearer_dependency
from ballast.server.respond import collect_all
from ballast.server.responses import ResponsesRequest, echo_fields, to_chat
from ballast.server.responses_out import ResponseEvents, ResponseShape, answer_items, item_id
from ballast.server.state import ServerState
from ballast.server.translate import ending, start_chat, stream_blocks, whole_answer
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def responses_router(api_key: str | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(bearer_dependency(api_key))])

    @router.post("/responses", response_model=None)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        state: ServerState = request.app.state.ballast
        begun = await start_chat(state, lambda: to_chat(body), request)
        if begun is None:
            return Response(status_code=499)
        job, started = begun
        assert state.engine is not None
        shape = ResponseShape(item_id("resp"), job.model, echo_fields(body), state.engine.tokenizer)
        if job.stream:
            events = stream_blocks(state, job, started, ResponseEvents(shape))
            return StreamingResponse(events, media_type="text/event-stream", headers=STREAM_HEADERS)
        [result] = await collect_all(state, job, started, request)
        answer = whole_answer(job, result)
        end = ending(
            job, state.engine.tokenizer, result.finish, result.token_ids, result.text, bool(answer.calls)
        )
        return JSONResponse(shape.body(answer_items(answer), end))

    return router
